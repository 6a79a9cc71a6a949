"""The ``[gift]`` section of the torchtitan config tree (``--gift.*`` on the CLI).

torchtitan parses its config with tyro from dataclasses, so the section is a plain
dataclass whose fields mirror :class:`gift_compile.GiftConfig`, plus ``enable`` and ``fuse``
(integration switches). Values are validated by converting to ``GiftConfig`` in ``__post_init__``: a bad ``--gift.format`` or
TOML value fails while the command line is parsed, before any process group exists, with
``GiftConfig``'s message naming the field and the allowed values.

``reduce_op`` is not a field: torchtitan divides the loss by the global token count and
disables FSDP's gradient division, so gradient collectives must SUM. The section always
converts with ``reduce_op="sum"``. Nor is ``second_hop_error_feedback``: torchtitan's gradient
paths are reduce-scatters (FSDP, and HSDP's shard hop), which have no re-encoded second hop
(`GiftState` refuses it there).

``geometry`` and ``select_metric`` default to ``auto``, as in ``GiftConfig``: the section
carries ``auto`` into the config, and the hook (`gift_compile.torchtitan_ext.hooks`) resolves it
once the optimizers exist with the same function as `gift_compile.apply`
(`gift_compile.api.resolve_auto`: lowrank / whitened under a matrix preconditioner such as
Muon or Shampoo, second_moment / whitened under Adam/AdamW, none / euclidean otherwise).
``auto_by_optimizer``, the spelling the shipped TOMLs and docs used before the two resolutions
became one, stays accepted as an alias of ``auto`` (`AUTO_ALIAS`), so TOMLs and command lines
written with it keep working; the section stores it as ``auto``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from gift_compile.config import AUTO_GEOMETRY, GiftConfig, GiftConfigError, SelectMetric

__all__ = ["AUTO_ALIAS", "GiftSection"]

_DEFAULTS = GiftConfig()
# The former torchtitan spelling of "auto" (geometry and select_metric), kept for existing TOMLs.
AUTO_ALIAS = "auto_by_optimizer"
_AUTO = {"geometry": AUTO_GEOMETRY, "select_metric": SelectMetric.AUTO}
# Fields that steer the torchtitan integration rather than GIFT's numerics.
_INTEGRATION_FIELDS = ("enable", "fuse")


@dataclass(kw_only=True, slots=True)
class GiftSection:
    """GIFT toggles: ``enable`` and ``fuse`` steer the integration, the rest is GiftConfig."""

    enable: bool = False
    """Rewrite the gradient collectives into GIFT's low-precision collectives."""

    fuse: bool = True
    """Compile GIFT's ops with Inductor so they fuse into a few kernels.

    graph_trainer: regional Inductor over the inserted ops (no effect with
    --compile.inductor_compilation full, which compiles everything). FSDP2: the custom
    reduce-scatter calls the torch.compile'd core collective (one compile per gradient
    shape). Costs compile time at the first step (CPU, llama3 debug: graph ~60-75 s cold,
    FSDP2 ~1 min); --gift.no-fuse runs the same ops eagerly (identical numbers)."""

    format: str = _DEFAULTS.format
    """Wire format: fp32, bf16, fp8_e4m3, fp8_e5m2, mxfp8, nvfp4, mxint4, int6, int4, int3, int2, ternary
    (the frontier's fewest bits within fp32's noise: int2 + leaky error feedback under Muon, int3 under AdamW)."""

    scaling: str = _DEFAULTS.scaling
    """Scale granularity for the fp8 formats: tensor, row, block (block-scaled formats ignore it)."""

    block_size: int = _DEFAULTS.block_size
    """Scale block length: fp8 with scaling=block (any even size); int6, int4, int3, int2, ternary: 16 or 32."""

    geometry: str = _DEFAULTS.geometry
    """Quantization coordinates: none, hadamard, dense, lowrank, gradient, momentum (the map from the
    optimizer's momentum, what Muon orthogonalizes), second_moment (input columns scaled by AdamW's
    exp_avg_sq), auto (lowrank under Muon/Shampoo-style optimizers, second_moment under
    Adam/AdamW, else none; auto_by_optimizer is an alias)."""

    rank: int = _DEFAULTS.rank
    """Rank of the low-rank part of the whitening."""

    refresh_every: int = _DEFAULTS.refresh_every
    """Steps between geometry refreshes."""

    refresh_warmup: int = _DEFAULTS.refresh_warmup
    """First refresh after this many steps, spacing doubling up to refresh_every (0: none)."""

    ema: float = _DEFAULTS.ema
    """EMA decay of the K-FAC statistics."""

    damping: float = _DEFAULTS.damping
    """Relative diagonal floor of the whitening."""

    select: str = "auto"
    """auto | all | none | boundary_hits:K | comma-separated FQN globs."""

    exclude: list[str] = field(default_factory=lambda: list(_DEFAULTS.exclude))
    """Comma-separated FQN globs that always stay at full precision."""

    error_feedback: bool = _DEFAULTS.error_feedback
    """Carry the quantization residual (in transformed coordinates) to the next step."""

    error_feedback_decay: float = _DEFAULTS.error_feedback_decay
    """Beta of the residual, e <- beta e + delta (1.0: plain error feedback; < 1: a leaky one)."""

    stochastic_rounding: bool = _DEFAULTS.stochastic_rounding
    """Stochastic rounding of the codes (seeded)."""

    block_rotation: bool = _DEFAULTS.block_rotation
    """Rotate each scale block (signed Walsh-Hadamard) before choosing its codes (block formats)."""

    layer_formats: list[str] = field(default_factory=list)
    """Per-layer wire formats, comma-separated "glob=format" entries (first match wins; others use format)."""

    min_numel: int = _DEFAULTS.min_numel
    """2-D weights with fewer elements get no map; they and 1-D tensors travel at tiny_format."""

    unmapped_format: str = _DEFAULTS.unmapped_format
    """Gradients outside GIFT's layers that exclude does not match: same (= format) | a wire format |
    fp32 (the opt-out), in plain coordinates in the same collective (FSDP2 trainer)."""

    excluded_format: str = _DEFAULTS.excluded_format
    """Gradients exclude matches (embedding, output head): bf16 | same (= format) | a wire format |
    fp32 (the opt-out), in plain coordinates in the same collective (FSDP2 trainer)."""

    tiny_format: str = _DEFAULTS.tiny_format
    """Tiny gradients (norms, biases: < 2 dims or < min_numel elements): bf16 | fp32 (the opt-out)."""

    stats_tokens: int = _DEFAULTS.stats_tokens
    """Tokens per step and layer that enter the K-FAC statistics."""

    nonfinite: str = _DEFAULTS.nonfinite
    """What a NaN/Inf gradient does: error | propagate."""

    seed: int = _DEFAULTS.seed
    """Seed of stochastic rounding and Hadamard signs."""

    select_metric: str = _DEFAULTS.select_metric
    """select=auto compares the paths by: euclidean | whitened (the error preconditioners see) |
    auto (whitened under Muon/Shampoo-style optimizers, and with geometry second_moment, which auto
    picks under Adam/AdamW: so AdamW resolves to whitened too; else euclidean; auto_by_optimizer is an alias)."""

    auto_min_gain: float = _DEFAULTS.auto_min_gain
    """select=auto: minimum error reduction for a layer to take the transformed path."""

    auto_max_overhead: float = _DEFAULTS.auto_max_overhead
    """select=auto: maximum map time as a fraction of the layer's step time without it (backward
    at this rank's tokens plus a bf16 exchange over auto_network_gbps, priced as on an H200)."""

    auto_network_gbps: float = _DEFAULTS.auto_network_gbps
    """select=auto: network bandwidth per GPU (Gb/s) the cost side prices a layer's exchange at."""

    unrewritten: str = _DEFAULTS.unrewritten
    """A managed gradient the pass cannot rewrite, or (FSDP2, expert parallelism) routed experts on
    another mesh than GIFT's: error | warn (then it goes at full precision)."""

    plan_check: str = _DEFAULTS.plan_check
    """Cross-rank plan check of eager (FSDP2) collectives: first | always (debug)."""

    residual_format: str = _DEFAULTS.residual_format
    """Storage format of error-feedback residuals (fp32 exact; e.g. fp8_e4m3 for 8 bits)."""

    statistics: str = _DEFAULTS.statistics
    """K-FAC input statistics: sketch (O(d_in * k), Nyström) | dense (exact d_in x d_in)."""

    sketch_cols: int = _DEFAULTS.sketch_cols
    """Sketch columns k (0: twice the rank)."""

    reselect_every: int = _DEFAULTS.reselect_every
    """Re-decide a measured selection every N refreshes (0: decide once; a change moves tensors the graphs read: no recompile)."""

    replica_format: str = _DEFAULTS.replica_format
    """HSDP's cross-replica hop (all-reduce of the reduced shard, across nodes): a wire format, or
    same (= format). The shard hop (reduce-scatter, inside a node) uses format under shard_hop=gift."""

    shard_hop: str = _DEFAULTS.shard_hop
    """HSDP's shard hop (reduce-scatter inside a node): gift (the layers on GIFT's codec at format, then
    the reduced shards again at replica_format) | native (FSDP2's own reduce-scatter at the gradient's
    dtype; only the replica hop codes, each rank's rows with the layers' maps and error feedback; needs
    replica_format=same; the stock FSDP2 trainer only)."""

    map_precision: str = _DEFAULTS.map_precision
    """The low-rank map's matmuls: auto (TF32 tensor-core kernels on CUDA, exact elsewhere) |
    exact (fixed-order fp32) | tf32 | bf16 (tensor-core kernels, fp32 accumulation; CUDA only)."""

    ranks_per_node: int | None = _DEFAULTS.ranks_per_node
    """Node layout of the exchange: None (the launcher's LOCAL_WORLD_SIZE) | 0 (one level) | g (global
    ranks g to a node). Where a group spans nodes each collective runs in two levels: the node's
    native reduce-scatter, then GIFT's codec on the 1/g chunk across nodes."""

    intra_node_format: str = _DEFAULTS.intra_node_format
    """Precision of the two-level exchange inside the node: native (the gradient's dtype; an
    all-reduce's result chunks fp32) | bf16 (both at bf16: half an fp32 gradient's NVLink bytes)."""

    recipe: str = _DEFAULTS.recipe
    """A named recipe: muon-nvfp4, muon-int2-leaky-ef (Muon), adamw-int3 (AdamW); it sets the [gift]
    keys the TOML leaves out (on the command line it replaces the TOML's recipe and keys; other --gift.* flags
    win); gift-train logs each key or flag that replaces a recipe's value and names the recipe when one does
    not combine with it, and a recipe measured under another optimizer than the run's is warned about on every rank."""

    def __post_init__(self) -> None:
        for name in _INTEGRATION_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GiftSection.{name}={getattr(self, name)!r} is invalid; allowed: true or false")
        for name, auto in _AUTO.items():  # the alias is stored as the one spelling
            if getattr(self, name) == AUTO_ALIAS:
                setattr(self, name, auto)
        self.to_gift_config()  # validates every value while the command line is parsed

    def to_gift_config(self) -> GiftConfig:
        """The validated GiftConfig (raises ValueError naming the bad field); an automatic
        geometry or metric stays ``auto`` for `gift_compile.api.resolve_auto` to resolve."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _INTEGRATION_FIELDS}
        # tyro parses list[str] from one "a,b,c" token, so `--gift.exclude ""` ([""]) is how the
        # command line says "exclude nothing"; any other empty glob is an error in GiftConfig.
        values["exclude"] = () if values["exclude"] == [""] else values["exclude"]
        try:
            # torchtitan's metrics print their own progress (`telemetry`): no GIFT progress lines
            return GiftConfig(reduce_op="sum", progress_every=0, **values)
        except GiftConfigError as err:
            if err.field in _AUTO:  # the section also accepts the alias
                raise GiftConfigError(err.field, err.value, f"{err.allowed}, {AUTO_ALIAS}") from None
            raise
