"""Schedules with several chains (DualPipe) on ppsim's executor: each rank runs its order directly.

torch's ``_PipelineScheduleRuntime`` numbers stages as one chain, so it would send the last stage of DualPipe's
first model copy into the first stage of the second. Here every rank holds one stage of each copy (stage ``j`` of
chain 0 on rank ``j``; stage ``R + j`` of chain 1 on rank ``R-1-j``, :mod:`ppsim.schedules.dualpipe`), built as
position ``j`` of the unsplit model's ``R``-stage split, so the two copies start from the same weights. Microbatches
are fed from both ends (chain ``d``'s microbatch ``i`` is microbatch ``d * M/2 + i`` of the batch), and the copies'
gradients of the same layer are summed before the check against the unsplit model, as DeepSeek's DualPipe does.

The rank walks its order: forward with autograd, ``B`` with torch's ``stage_backward``, ``I`` and ``W`` with
``stage_backward_input`` / ``stage_backward_weight`` (a chain's first stage defers its whole backward to ``W``, as
torch's stage does), an ``OVERLAP_F_B`` pair as its forward half then its backward half with both inputs' receives
posted first and both outputs sent after. Sends and receives are ``batch_isend_irecv`` ops tagged by (stage,
microbatch, direction), so messages between two ranks match whatever order they are posted in (gloo honours tags;
NCCL does not, so it is refused). Every computation is stamped by the shared
:class:`~ppsim.calibrate.execute.steps.Clock`; the step loop, gathering and assembly are
:func:`~ppsim.calibrate.execute.steps.measure_rank`'s.

torch is imported inside functions only.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ppsim.calibrate.execute.steps import Clock, ExecSpec, Measurement, RankRun, measure_rank

if TYPE_CHECKING:
    from ppsim.calibrate.execute.numerics import ReferenceCheck
    from ppsim.ir import Action, Schedule

_COPY = re.compile(r"^copy(\d+)/")


def backend_refusal(schedule: Schedule, backend: str) -> str | None:
    """Why this executor cannot run ``schedule`` on ``backend`` (``None`` when it can)."""
    if backend != "gloo":
        return (f"{schedule.name} on --backend {backend}: ppsim's executor matches the two chains' messages by tag, "
                "which only gloo honours; use --backend gloo")
    return None


# --- gradients of the two copies ---------------------------------------------------------------------------------
def copy_name(direction: int, name: str) -> str:
    """The gathered name of a parameter of model copy ``direction`` (its reference name, tagged by copy)."""
    return name if direction == 0 else f"copy{direction}/{name}"


def sum_copies(grads: dict[str, Any]) -> dict[str, Any]:
    """Every copy's gradient of the same reference parameter summed (DeepSeek's DualPipe sums them)."""
    out: dict[str, Any] = {}
    for key, grad in grads.items():
        name = _COPY.sub("", key)
        out[name] = out[name] + grad if name in out else grad
    return out


def copies_reference(spec: ExecSpec, device: Any) -> Callable[[dict[str, Any]], ReferenceCheck]:
    """The check of gathered gradients: copies summed, then compared with the unsplit model on all microbatches."""
    from ppsim.calibrate.execute.numerics import check_against_reference

    schedule = spec.schedule

    def check(grads: dict[str, Any]) -> ReferenceCheck:
        return check_against_reference(spec.model, len(schedule.pipelines[0]), schedule.num_microbatches,
                                       sum_copies(grads), synthetic=spec.synthetic, seed=spec.seed, device=device,
                                       source=spec.source)

    return check


# --- one rank ----------------------------------------------------------------------------------------------------
def run_rank(spec: ExecSpec, rank: int, world: int, local_rank: int) -> Measurement | None:
    """One rank of a multi-chain schedule (gloo: :func:`backend_refusal` is checked before the ranks start): build
    its stages, step them, hand the measurement to rank 0."""
    import torch

    from ppsim.calibrate.execute.numerics import reference_name
    from ppsim.calibrate.models.transformer import loss_fn, make_batch

    schedule = spec.schedule
    device = torch.device("cpu")
    modules = {s: stage_module(spec, s, device) for s in schedule.stages_of(rank)}
    sleep_s = spec.sleep_s[rank] if spec.synthetic and spec.sleep_s is not None else None
    clock = Clock(sleep_s, False)
    runtime = ChainRuntime(spec, rank=rank, modules=modules, clock=clock, loss_fn=loss_fn, device=device)
    tokens, targets = make_batch(spec.model, schedule.num_microbatches, seed=spec.seed)
    length = len(schedule.pipelines[0])

    def grad_name(stage: int, name: str) -> str:
        ref = reference_name(spec.model, length, schedule.position(stage), name, synthetic=spec.synthetic,
                             counts=spec.layer_counts, source=spec.source)
        return copy_name(schedule.direction(stage), ref)

    run = RankRun(parts=modules, runtime=runtime, clock=clock, tokens=tokens, targets=targets,
                  has_first=any(schedule.prev_stage(s) is None for s in modules),
                  has_last=any(schedule.next_stage(s) is None for s in modules), grad_name=grad_name)
    return measure_rank(spec, rank, world, device, run, reference=copies_reference(spec, device))


def stage_module(spec: ExecSpec, stage: int, device: Any) -> Any:
    """``stage``'s module: its chain position's slice of the unsplit model (both copies from the same weights)."""
    from ppsim.calibrate.execute.numerics import build_modules

    schedule = spec.schedule
    length = len(schedule.pipelines[schedule.direction(stage)])
    position = schedule.position(stage)
    return build_modules(spec.model, length, [position], synthetic=spec.synthetic, seed=spec.seed, device=device,
                         counts=spec.layer_counts, source=spec.source)[position]


class ChainRuntime:
    """Runs one rank's order of a multi-chain schedule; ``step`` is called as :func:`measure_rank` calls torch's
    runtime (``step(tokens?, losses=..., target=...)``)."""

    def __init__(self, spec: ExecSpec, *, rank: int, modules: dict[int, Any], clock: Clock, loss_fn: Any,
                 device: Any, peers: Sequence[int] | None = None, group: Any = None) -> None:
        """``peers``: the global rank of each pipeline rank (``None``: the same numbers); ``group``: their process
        group (``None``: the world), for sends, receives and each stage's backward bookkeeping."""
        from ppsim.calibrate.execute import torch_adapter
        from ppsim.calibrate.models.transformer import DTYPES

        self.schedule = spec.schedule
        self.order = spec.schedule.actions[rank]
        self.modules = modules
        self.clock = clock
        self.loss_fn = loss_fn
        self.recompute = spec.recompute
        self.boundary = (spec.model.boundary_shape, DTYPES[spec.model.dtype], device)
        self.peers = peers
        self.group = group
        length = len(spec.schedule.pipelines[0])
        # each stage's backward as torch's runtime runs it (under FSDP: gradients reduced once, after the step)
        self.backward = {s: torch_adapter.ChainBackward(m, spec.schedule.position(s), length, device, group=group)
                         for s, m in modules.items()}
        last: dict[int, int] = {}  # stage -> position of its last backward (B or W) in the order
        for position, action in enumerate(self.order):
            for comp in action.computations:
                if comp.type.value in ("B", "W"):
                    last[comp.stage] = position
        self._last_backward: dict[int, list[int]] = {}
        for stage, position in last.items():
            self._last_backward.setdefault(position, []).append(stage)
        self._reset()

    def _reset(self) -> None:
        self._saved: dict[tuple[int, int], tuple[Any, Any]] = {}  # forward output (or scaled loss), inputs
        self._deferred: dict[tuple[int, int], tuple[Any, ...]] = {}  # what W needs after I
        self._posted: dict[tuple[int, int, str], tuple[Any, list[Any]]] = {}
        self._sends: list[tuple[Any, list[Any]]] = []
        self._held: list[tuple[Any, int, int, str]] | None = None  # a pair's sends, until both halves are done

    # --- a step: the order, then the sends' completion
    def step(self, *args: Any, losses: list[Any], return_outputs: bool = False, target: Any = None) -> None:
        m = self.schedule.num_microbatches
        self._tokens = args[0].chunk(m) if args else None
        self._targets = target.chunk(m) if target is not None else None
        self._losses = losses
        for backward in self.backward.values():
            backward.begin_step()
        for position, action in enumerate(self.order):
            if action.sub_actions:
                self._pair(action)
            else:
                self._compute(action)
            for stage in self._last_backward.get(position, ()):
                self.backward[stage].end_step()
        for _, works in self._sends:
            for work in works:
                work.wait()
        if self._saved or self._deferred or self._posted:
            raise RuntimeError(f"{self.schedule.name}: computations left unfinished after the order (ppsim bug)")
        self._reset()

    def _pair(self, action: Action) -> None:
        """An overlapped forward/backward pair: both inputs' receives posted, the forward and backward halves, then
        both outputs sent (the pair finishes as one, as DeepSeek's DualPipe and ppsim's simulator have it)."""
        halves = action.sub_actions
        for half in halves:
            need = self._needs(half)
            if need is not None and need not in self._posted:
                self._post(need)
        self._held = []
        for half in halves:
            self._compute(half)
        held, self._held = self._held, None
        for message in held:
            self._send(*message)

    def _compute(self, comp: Action) -> None:
        self.backward[comp.stage].ready()
        kind = comp.type.value
        if kind == "F":
            self._forward(comp.stage, comp.microbatch)
        elif kind in ("B", "I"):
            self._backward(comp.stage, comp.microbatch, full=kind == "B")
        else:
            self._weight(comp.stage, comp.microbatch)

    # --- computations
    def _forward(self, stage: int, mb: int) -> None:
        first, last = self.schedule.prev_stage(stage) is None, self.schedule.next_stage(stage) is None
        x = self._tokens[self._batch_index(stage, mb)] if first else self._receive((stage, mb, "F")).requires_grad_()
        self.clock.begin(f"{stage}F{mb}")
        out = self._run_module(stage, mb, x)
        if last:
            loss = self.loss_fn(out, self._targets[self._batch_index(stage, mb)])
            self._losses.append(loss.detach())
            out = loss / self.schedule.num_microbatches  # the mean over all microbatches, as torch's scale_grads
        self.clock.finish()
        self._saved[(stage, mb)] = (out, x)
        if not last:
            self._send(out.detach(), stage, mb, "F")

    def _run_module(self, stage: int, mb: int, x: Any) -> Any:
        if (stage, mb) in self.recompute:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.modules[stage], x, use_reentrant=False)
        return self.modules[stage](x)

    def _backward(self, stage: int, mb: int, *, full: bool) -> None:
        first, last = self.schedule.prev_stage(stage) is None, self.schedule.next_stage(stage) is None
        grad = None if last else [self._receive((stage, mb, "B"))]
        self.clock.begin(f"{stage}{'B' if full else 'I'}{mb}")
        out, x = self._saved.pop((stage, mb))
        dx: Any = None
        if full:
            dx = self._full(stage, out, grad, x)
        elif first:  # no input gradient to compute: W runs the whole backward (torch's stage does the same)
            self._deferred[(stage, mb)] = (out, grad, x)
        else:
            grads, groups = self.backward[stage].input_only([out], grad, [x])
            dx = grads[0]
            self._deferred[(stage, mb)] = (groups,)
        self.clock.finish()
        if not first:
            self._send(dx, self.schedule.prev_stage(stage), mb, "B")

    def _weight(self, stage: int, mb: int) -> None:
        self.clock.begin(f"{stage}W{mb}")
        deferred = self._deferred.pop((stage, mb))
        if len(deferred) == 3:
            out, grad, x = deferred
            self._full(stage, out, grad, x)
        else:
            self.backward[stage].weight_only(deferred[0])
        self.clock.finish()

    def _full(self, stage: int, out: Any, grad: list[Any] | None, x: Any) -> Any:
        """The whole backward; the input's gradient. A loss goes in alone (torch skips a list without gradients)."""
        return self.backward[stage].full(out if grad is None else [out], grad, [x])[0]

    def _batch_index(self, stage: int, mb: int) -> int:
        """Chain ``d``'s microbatch ``mb`` is the batch's microbatch ``d * (M / chains) + mb``."""
        return self.schedule.direction(stage) * self.schedule.microbatches_per_pipeline + mb

    # --- messages: tagged by the link's lower stage, the microbatch and the direction of travel
    def _needs(self, comp: Action) -> tuple[int, int, str] | None:
        """The receive a computation waits for (``None``: its input is local)."""
        kind = comp.type.value
        if kind == "F" and self.schedule.prev_stage(comp.stage) is not None:
            return (comp.stage, comp.microbatch, "F")
        if kind in ("B", "I") and self.schedule.next_stage(comp.stage) is not None:
            return (comp.stage, comp.microbatch, "B")
        return None

    def _tag(self, lower_stage: int, mb: int, kind: str) -> int:
        return 2 * (lower_stage * self.schedule.microbatches_per_pipeline + mb) + (kind == "B")

    def _post(self, key: tuple[int, int, str]) -> None:
        import torch
        import torch.distributed as dist

        stage, mb, kind = key
        peer_stage = self.schedule.prev_stage(stage) if kind == "F" else self.schedule.next_stage(stage)
        assert peer_stage is not None
        lower = peer_stage if kind == "F" else stage
        shape, dtype, device = self.boundary
        buf = torch.empty(shape, dtype=dtype, device=device)
        peer = self._global(self.schedule.stage_to_rank[peer_stage])
        self.clock.post(stage, mb, kind)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, peer, group=self.group,
                                                   tag=self._tag(lower, mb, kind))])
        self._posted[key] = (buf, works)

    def _receive(self, key: tuple[int, int, str]) -> Any:
        if key not in self._posted:
            self._post(key)
        buf, works = self._posted.pop(key)
        t0 = time.perf_counter()
        for work in works:
            work.wait()
        self.clock.add_wait(time.perf_counter() - t0)
        return buf

    def _send(self, tensor: Any, lower_stage: int, mb: int, kind: str) -> None:
        """``tensor`` (F: ``lower_stage``'s output; B: its input gradient) to the rank holding the other end (held
        back while a pair runs)."""
        import torch.distributed as dist

        if self._held is not None:
            self._held.append((tensor, lower_stage, mb, kind))
            return

        other = self.schedule.next_stage(lower_stage) if kind == "F" else lower_stage
        assert other is not None
        peer = self._global(self.schedule.stage_to_rank[other])
        tensor = tensor.contiguous()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer, group=self.group,
                                                   tag=self._tag(lower_stage, mb, kind))])
        self._sends.append((tensor, works))

    def _global(self, pp_rank: int) -> int:
        return pp_rank if self.peers is None else self.peers[pp_rank]
