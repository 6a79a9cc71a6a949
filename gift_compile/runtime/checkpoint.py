"""Checkpointing of a `GiftState`: `state_dict` / `load_state_dict` (torch.distributed.checkpoint's
Stateful), with validation and the conversions a changed config allows.

`GiftState` inherits it; the fields it reads are `GiftState`'s.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import torch

from gift_compile.codec import residual as residual_store
from gift_compile.config import GiftConfig
from gift_compile.sync import group_rank

if TYPE_CHECKING:
    from gift_compile.exchange.topology import NodeLayout
    from gift_compile.runtime.layer import LayerState, OutsideResidual

__all__ = ["Checkpointing", "STATE_VERSION"]

logger = logging.getLogger("gift_compile")

STATE_VERSION = 2
# (config flag, state-dict prefix) of each error-feedback residual a layer may keep
_RESIDUALS = (("error_feedback", "residual"), ("second_hop_error_feedback", "second_hop_residual"))
# state-dict prefix of the residuals of gradients sent outside the layers (`GiftState.outside`):
# not a module name, so no layer's keys can start with it
OUTSIDE = "outside:"
# state-dict prefix of the i-th state this one drives (`GiftState.substates`): `sub<i>:`
SUB = "sub{}:"


class Checkpointing:
    """Saving and loading a `GiftState` (a mixin: no fields of its own)."""

    __slots__ = ()
    config: GiftConfig
    group: Any
    layers: dict[str, LayerState]
    outside: dict[str, OutsideResidual]
    substates: list[Any]
    seed: torch.Tensor
    steps: int
    _sharing_checked: bool
    exchange: tuple[int, NodeLayout]



    # ---- checkpointing -----------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        layout = self.exchange[1]
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "sharing_checked": self._sharing_checked,
            "shared": {l.fqn: [f.fqn for f in l.followers] for l in self.layers.values() if l.followers},
            "layers": {n: {"shape": list(l.shape), "kind": l.kind, "rank": l.transform.rank,
                           "error_feedback": l.residual is not None,
                           "second_hop_error_feedback": l.second_hop_residual is not None,
                           "residual_format": self.config.residual_format if l.residual_buffers() else None}
                       for n, l in self.layers.items()},
            "outside": {n: {"shape": list(o.shape), "residual_format": self.config.residual_format}
                        for n, o in self.outside.items()},
            "substates": len(self.substates),
            # whose: residuals, probes and statistics accumulators are this rank's own
            "group_rank": group_rank(self.group), "world": self.world(),
            # where the ranks of the layers' collective sat (`exchange.topology`; the state's group,
            # or HSDP's shard group, `GiftState.exchange`): a two-level exchange's first-hop
            # residuals hold the node chunk's rows of that layout (`_check_node_layout`)
            "node_layout": {"ranks_per_node": layout.ranks_per_node, "nodes": layout.nodes if layout.two_level else 1},
        }

    def state_dict(self) -> dict[str, Any]:
        """A snapshot (detached copies): loaders such as DCP write into the tensors they are
        given before `load_state_dict` validates them, which must not touch the live state."""
        sd: dict[str, Any] = {"meta": json.dumps(self._meta(), sort_keys=True), "seed": self.seed.detach().clone(),
                              "steps": torch.tensor(self.steps)}
        for name, layer in self.layers.items():
            sd.update({f"{name}.{k}": v.detach().clone() for k, v in layer.state_dict().items()})
        for name, outside in self.outside.items():
            sd.update({f"{OUTSIDE}{name}.{i}": t.detach().clone() for i, t in enumerate(outside.buffers)})
        for i, sub in enumerate(self.substates):
            sd.update({f"{SUB.format(i)}{k}": v for k, v in sub.state_dict().items()})
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a checkpoint after validating it against this state; raises ValueError naming
        the layer and key that do not fit, before anything is modified.

        Accepted with a logged conversion: a different wire format, refresh cadence, EMA,
        damping or selection rule (the saved geometry stays valid), and turning error feedback
        on (residuals start at zero), another node layout when the checkpoint holds no
        first-hop residual (nothing else in the state depends on it). Refused: another rank's
        or data-parallel size's state, another node layout with first-hop residuals
        (`_check_node_layout`), other layers, shapes, geometry kind or rank,
        turning error feedback off with saved residuals, and non-finite tensors. The residuals
        of gradients sent outside the layers (`GiftState.outside`) follow the same rules; one
        the checkpoint lacks starts at zero (it predates them, or error feedback was off).
        """
        if "meta" not in sd:
            raise ValueError("GIFT checkpoint has no 'meta' entry: it was not written by this version of GiftState")
        meta = json.loads(sd["meta"]) if isinstance(sd["meta"], str) else sd["meta"]
        mine = self._meta()
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"GIFT checkpoint version {meta.get('version')} != {STATE_VERSION}")
        saved_at, here = (meta.get("group_rank"), meta.get("world")), (mine["group_rank"], mine["world"])
        if saved_at != (None, None) and saved_at != here:
            raise ValueError(f"GIFT checkpoint was saved by rank {saved_at[0]} of {saved_at[1]} and this is rank "
                             f"{here[0]} of {here[1]}: its error-feedback residuals, probes and statistics are that "
                             "rank's own (another rank's would be added to this rank's gradients); load each rank's "
                             "own GIFT state on the same data-parallel size")
        converted: list[str] = []
        self._check_node_layout(meta, mine, converted)
        saved_layers, my_layers = meta["layers"], mine["layers"]
        missing, extra = sorted(set(my_layers) - set(saved_layers)), sorted(set(saved_layers) - set(my_layers))
        if missing or extra:
            raise ValueError(f"GIFT checkpoint layers differ: missing {missing}, unexpected {extra}")
        for name, want in my_layers.items():
            got = saved_layers[name]
            for key in ("shape", "kind", "rank"):
                if got[key] != want[key]:
                    raise ValueError(f"GIFT checkpoint: layer {name}: {key} {got[key]} != expected {want[key]}")
            for flag, prefix in _RESIDUALS:
                had, has = bool(got.get(flag, False)), bool(want[flag])  # older checkpoints: no second hop
                if had and not has:
                    raise ValueError(f"GIFT checkpoint: layer {name} has a {prefix} but {flag} is off now; its "
                                     "accumulated error would be lost")
                if has and not had:
                    converted.append(f"{name}: {prefix} starts at zero ({flag} newly on)")
        recoded: dict[tuple[str, str], torch.Tensor] = {}  # residuals saved in another format, as fp32
        for name, layer in self.layers.items():
            got, want = saved_layers[name], my_layers[name]
            for flag, prefix in _RESIDUALS:
                if not (got.get(flag, False) and want[flag]) or got["residual_format"] == want["residual_format"]:
                    continue
                recoded[(name, prefix)] = _saved_residual(sd, f"{name}.{prefix}", got["residual_format"],
                                                          layer.shape[1], f"layer {name}", prefix)
                converted.append(f"{name}: {prefix} re-stored from {got['residual_format']} to {want['residual_format']}")
        plan: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, layer in self.layers.items():
            for key, dst in layer.state_dict().items():
                full = f"{name}.{key}"
                prefix = key.rsplit(".", 1)[0]
                flag = dict((p, f) for f, p in _RESIDUALS).get(prefix)
                if flag is not None and ((name, prefix) in recoded or not saved_layers[name].get(flag, False)):
                    continue
                if full not in sd:
                    raise ValueError(f"GIFT checkpoint: layer {name}: key {key!r} is missing")
                src = torch.as_tensor(sd[full])
                if src.shape != dst.shape:
                    raise ValueError(f"GIFT checkpoint: layer {name}: key {key!r} has shape {tuple(src.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                if src.is_floating_point() and not bool(torch.isfinite(src).all()):
                    raise ValueError(f"GIFT checkpoint: layer {name}: key {key!r} holds NaN/Inf values")
                if key not in ("selected", "decided", "boundary_score"):
                    plan.append((dst, src))
        recoded_outside = self._outside_plan(sd, meta.get("outside", {}), plan, converted)
        if meta.get("substates", 0) != len(self.substates):
            raise ValueError(f"GIFT checkpoint drives {meta.get('substates', 0)} further states (the routed experts' "
                             f"layers), this state {len(self.substates)}")
        unknown = sorted(k for k in sd if k not in ("meta", "seed", "steps")
                         and not any(k.startswith(f"{n}.") for n in self.layers)
                         and not any(k.startswith(f"{OUTSIDE}{n}.") for n in self.outside)
                         and not any(k.startswith(SUB.format(i)) for i in range(len(self.substates))))
        if unknown:
            raise ValueError(f"GIFT checkpoint has unexpected keys {unknown[:5]}")
        # each driven state validates its own entries before it changes anything, and before this one
        for i, sub in enumerate(self.substates):
            prefix = SUB.format(i)
            sub.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)})
        for dst, src in plan:
            dst.copy_(src)
        for (name, prefix), value in recoded.items():
            residual_store.write(self.config.residual_format, self.layers[name].residual_buffers()[prefix], value)
        for name, value in recoded_outside.items():
            residual_store.write(self.config.residual_format, self.outside[name].buffers, value)
        for leader, followers in meta.get("shared", {}).items():
            if not self.layers[leader].followers:
                self.share_statistics([leader, *followers])
        self._sharing_checked = bool(meta.get("sharing_checked", False))
        for name, layer in self.layers.items():
            self.set_selected(layer, bool(sd[f"{name}.selected"]), decided=bool(sd[f"{name}.decided"]))
            layer.boundary_score = float(sd[f"{name}.boundary_score"])
        self.seed.copy_(torch.as_tensor(sd["seed"]))
        self.steps = int(sd["steps"])
        changed = {k: (meta["config"].get(k), v) for k, v in mine["config"].items() if meta["config"].get(k) != v}
        if changed:
            converted.append(f"config changed since the checkpoint: {changed}")
        for line in converted:
            logger.warning("GIFT checkpoint loaded with a conversion: %s", line)

    def _check_node_layout(self, meta: dict[str, Any], mine: dict[str, Any], converted: list[str]) -> None:
        """Refuse a checkpoint saved on another node layout (`GiftConfig.ranks_per_node` over the
        same world) that holds first-hop error-feedback residuals: under two levels each rank's
        residual is the rows of its node chunk, which stage 2 rounds (`node_stage.residual_rows`),
        so another layout's rows would be added to the wrong gradient rows. Every other tensor
        of the state (maps, statistics, probes, seeds, the second hop's residual, which is the
        rank's one-level shard) is the same on every layout: without first-hop residuals the
        change is accepted and logged. A checkpoint without the entry predates it: the
        residuals' shapes (rows / g under two levels) are then what tells layouts apart."""
        saved = meta.get("node_layout")
        here = mine["node_layout"]
        if saved is None or saved == here:
            return

        def words(d: dict[str, int]) -> str:
            if d["ranks_per_node"] == 1:
                return "the one-level exchange"
            return f"two levels, {d['nodes']} nodes x {d['ranks_per_node']} ranks"

        residuals = sorted([n for n, l in meta["layers"].items() if l.get("error_feedback", False)]
                           + [f"{OUTSIDE}{n}" for n in meta.get("outside", {})])
        if residuals:
            setting = saved["ranks_per_node"] if saved["ranks_per_node"] > 1 else 0
            raise ValueError(
                f"GIFT checkpoint was saved on {words(saved)} and this state runs {words(here)} over the same "
                f"{mine['world']} ranks: the error-feedback residuals of {residuals[:3]}"
                f"{' ...' if len(residuals) > 3 else ''} hold the rows that layout's exchange rounds (a two-level "
                "exchange's: the node chunk's), which would be added to other gradient rows here; resume with "
                f"GiftConfig.ranks_per_node={setting}")
        converted.append(f"node layout changed from {words(saved)} to {words(here)} (no first-hop residual in the "
                         "checkpoint: nothing in it depends on the layout)")

    def _outside_plan(self, sd: dict[str, Any], saved: dict[str, Any], plan: list[tuple[torch.Tensor, torch.Tensor]],
                      converted: list[str]) -> dict[str, torch.Tensor]:
        """Validate the checkpoint's residuals of gradients sent outside the layers against
        `self.outside` (nothing modified): append the copies to `plan` and the conversions to
        `converted`; return the residuals saved in another format, as fp32, by name."""
        lost = sorted(set(saved) - set(self.outside))
        if lost:
            why = "error_feedback is off now" if not self.config.error_feedback else "this run keeps none for them"
            raise ValueError(f"GIFT checkpoint: {lost} have error-feedback residuals but {why}; their accumulated "
                             "error would be lost")
        recoded: dict[str, torch.Tensor] = {}
        for name, outside in self.outside.items():
            got = saved.get(name)
            if got is None:
                converted.append(f"{name}: residual starts at zero (not in the checkpoint)")
                continue
            if list(got["shape"]) != list(outside.shape):
                raise ValueError(f"GIFT checkpoint: {name}: residual shape {got['shape']} != expected "
                                 f"{list(outside.shape)}")
            fmt = got["residual_format"]
            if fmt != self.config.residual_format:
                value = _saved_residual(sd, f"{OUTSIDE}{name}", fmt, outside.shape[1], name, "residual")
                if tuple(value.shape) != outside.shape or not bool(torch.isfinite(value).all()):
                    raise ValueError(f"GIFT checkpoint: {name}: its {fmt} residual decodes to shape "
                                     f"{tuple(value.shape)} (expected {outside.shape}) or holds NaN/Inf values")
                recoded[name] = value
                converted.append(f"{name}: residual re-stored from {fmt} to {self.config.residual_format}")
                continue
            for i, dst in enumerate(outside.buffers):
                src = torch.as_tensor(sd.get(f"{OUTSIDE}{name}.{i}", torch.empty(0)))
                if src.shape != dst.shape:
                    raise ValueError(f"GIFT checkpoint: {name}: residual buffer {i} has shape {tuple(src.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                if src.is_floating_point() and not bool(torch.isfinite(src).all()):
                    raise ValueError(f"GIFT checkpoint: {name}: residual buffer {i} holds NaN/Inf values")
                plan.append((dst, src))
        return recoded


def _saved_residual(sd: dict[str, Any], key: str, fmt: str, cols: int, what: str, noun: str) -> torch.Tensor:
    """The residual a checkpoint saved under `<key>.<i>` in another residual format, `fmt`,
    decoded to fp32 (a layer's or one sent outside the layers: both are re-stored in this
    state's format); a ValueError naming `what` where it does not decode."""
    bufs = tuple(torch.as_tensor(sd.get(f"{key}.{i}", torch.empty(0))) for i in range(residual_store.buffer_count(fmt)))
    try:
        return residual_store.read(fmt, bufs, cols)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"GIFT checkpoint: {what}: unreadable {fmt} {noun}: {e}")
