"""K-FAC and EK-FAC: a model's Fisher, layer by layer, as Kronecker factors; gradients
preconditioned by it.

A linear layer ``y = W a + b`` has, for one sample of tokens ``t``, the gradient ``G = sum_t g_t
a_t^T`` (``[out, in]``; where its bias is selected too, a last column, and every ``a`` ends in a
1), with ``a_t`` the layer's input and ``g_t`` the loss's gradient by its output. Its Fisher, over
the fitting samples ``i`` and with ``vec`` reading a matrix row by row,
``F = E_i[vec(G_i) vec(G_i)^T]``, is approximated by

- K-FAC (Martens and Grosse, 2015): ``S (x) A``, with ``A`` the inputs' covariance (``a a^T``
  summed over every token, over the tokens) and ``S`` the output gradients' (``g g^T`` summed
  over every token, over the samples): exact for samples of one token whose inputs and output
  gradients are independent. With ``A = Q_A diag(l_A) Q_A^T`` and ``S = Q_S diag(l_S) Q_S^T``,
  ``S (x) A`` is diagonal in the basis ``Q_S (x) Q_A``, with eigenvalues ``l_S[o] l_A[j]``;
- EK-FAC (George et al., 2018): the same basis, its eigenvalues replaced by the fitting
  samples' second moments there, ``Lambda = E_i[(Q_S^T G_i Q_A)^2]``: of the matrices diagonal
  in that basis, the one nearest ``F`` (Frobenius).

So ``(F + lambda I)^-1 vec(G) = vec(Q_S [(Q_S^T G Q_A) / (Lambda + lambda)] Q_A^T)``, elementwise,
at the cost of four products of a layer's size. The linear layers are ``nn.Linear`` modules and
an exported program's ``aten.linear`` and ``aten.addmm`` (Hugging Face's ``Conv1D``, its weight
``[in, out]``: :class:`Linear`'s ``transposed``). Every other selected parameter (embeddings,
norms, convolutions, a weight read another way) is preconditioned by its diagonal Fisher
``E_i[g_i^2]`` (EK-FAC in the identity basis), never left out.

Fitting takes two passes over the fitting samples, one sample at a time with plain autograd
(:func:`covariances`, then :func:`corrections` in the eigenbases of the first); the Fisher is
the empirical one, of the loss at the samples' own targets, as the scores' gradients are.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from service.export.interpreter import named_args
from service.fast_stats._capture import bind
from service.losses import LOSSES
from service.registry import LoadedModel
from service.strategies.base import NAMED_INPUT, Tensors
from service.strategies.per_sample import sample_loss_of

Kind = Literal["kfac", "ekfac"]
KINDS: tuple[Kind, ...] = ("kfac", "ekfac")
DAMPING_RULE = "0.1 x the mean eigenvalue of F (trace(F) / P over the P fitted parameters)"
DAMPING_SHARE = 0.1
WIDE = torch.float64  # factors are summed and decomposed in float64


@dataclass(frozen=True)
class Linear:
    """A linear layer of the selected parameters: its weight's name, its bias's where that is
    selected too (else None: no column or row of ones), and whether the weight is ``[in, out]``
    (``x @ w + b``: Hugging Face's ``Conv1D``, ``aten.addmm`` in an exported graph).

    A layer's matrix ``G`` is its weight's gradient in the weight's own layout, the bias
    beside it: ``sum_t g_t a_t^T`` with a last column of ``sum_t g_t`` (``[out, in + 1]``), or,
    transposed, ``sum_t a_t g_t^T`` with a last row (``[in + 1, out]``). Its rows' side is
    called the output gradients and its columns' the inputs below: for a transposed layer the
    roles swap, and the math is the same."""

    weight: str
    bias: str | None
    transposed: bool = False


@dataclass
class Covariances:
    """The first pass's sums, per layer by weight name: ``a a^T`` and ``g g^T`` over every
    token, the tokens, and the samples seen."""

    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    samples: int = 0

    def add(self, other: Covariances) -> None:
        for name, a in other.inputs.items():
            self.inputs[name] = self.inputs[name] + a if name in self.inputs else a
            self.grads[name] = self.grads[name] + other.grads[name] if name in self.grads \
                else other.grads[name]
            self.tokens[name] = self.tokens.get(name, 0) + other.tokens[name]
        self.samples += other.samples


@dataclass(frozen=True)
class Basis:
    """A layer's eigenbases and K-FAC eigenvalues: ``A = Q_A diag(l_A) Q_A^T`` (``[in, in]``),
    ``S = Q_S diag(l_S) Q_S^T`` (``[out, out]``)."""

    q_inputs: torch.Tensor
    l_inputs: torch.Tensor
    q_grads: torch.Tensor
    l_grads: torch.Tensor

    def rotate(self, g: torch.Tensor) -> torch.Tensor:
        """``Q_S^T G Q_A`` of each ``G`` in ``[n, out, in]``."""
        return self.q_grads.T @ g @ self.q_inputs

    def back(self, g: torch.Tensor) -> torch.Tensor:
        """``Q_S G Q_A^T``, the inverse of :meth:`rotate`."""
        return self.q_grads @ g @ self.q_inputs.T


def bases(sums: Covariances) -> dict[str, Basis]:
    """Each layer's :class:`Basis`, of its covariances ``A`` and ``S`` (eigenvalues clipped at
    0: a covariance's negative ones are rounding)."""
    out = {}
    for name, a in sums.inputs.items():
        l_a, q_a = torch.linalg.eigh(a / max(sums.tokens[name], 1))
        l_s, q_s = torch.linalg.eigh(sums.grads[name] / max(sums.samples, 1))
        out[name] = Basis(q_a, l_a.clamp(min=0), q_s, l_s.clamp(min=0))
    return out


@dataclass
class Corrections:
    """The second pass's sums: per layer ``(Q_S^T G Q_A)^2``, per other parameter ``g^2``,
    over the samples seen."""

    layers: dict[str, torch.Tensor] = field(default_factory=dict)
    diagonal: dict[str, torch.Tensor] = field(default_factory=dict)
    samples: int = 0

    def add(self, other: Corrections) -> None:
        for mine, theirs in ((self.layers, other.layers), (self.diagonal, other.diagonal)):
            for name, s in theirs.items():
                mine[name] = mine[name] + s if name in mine else s
        self.samples += other.samples


@dataclass(frozen=True)
class Curvature:
    """A fitted curvature: the linear layers' bases and eigenvalues, the other parameters'
    diagonal Fisher."""

    layers: dict[str, Linear]
    bases: dict[str, Basis]
    corrected: dict[str, torch.Tensor]  # E_i[(Q_S^T G_i Q_A)^2], [out, in]
    diagonal: dict[str, torch.Tensor]  # E_i[g_i^2] of every other selected parameter
    samples: int

    def eigenvalues(self, name: str, kind: Kind) -> torch.Tensor:
        """Layer ``name``'s ``Lambda`` ``[out, in]`` in its basis: K-FAC's or EK-FAC's."""
        if kind == "ekfac":
            return self.corrected[name]
        basis = self.bases[name]
        return torch.outer(basis.l_grads, basis.l_inputs)

    def default_damping(self, kind: Kind) -> float:
        """:data:`DAMPING_RULE`: a tenth of ``F``'s mean eigenvalue, every layer's ``Lambda``
        and every diagonal entry counted once (for EK-FAC, ``trace(F)`` is the fitting
        samples' mean squared gradient norm: a rotation keeps a gradient's norm); it reads the
        curvature alone, never a retrained model, and is scale-free as TRAK's ``lambda`` rule
        is. 1.0 where ``F`` is 0."""
        values = [self.eigenvalues(name, kind) for name in self.layers]
        values += list(self.diagonal.values())
        count = sum(v.numel() for v in values)
        mean = float(sum(v.sum() for v in values)) / max(count, 1)
        return DAMPING_SHARE * mean if mean > 0 else 1.0

    def precondition(self, grads: Tensors, damping: float, kind: Kind, power: float = 1.0
                     ) -> Tensors:
        """``(F + damping I)^-power g`` of each sample's gradient ``{param: [n, *shape]}``
        (every parameter the curvature was fitted on), in float64: ``power`` 1 solves, 1/2
        whitens (both sides of a score preconditioned by half)."""
        if not damping > 0:
            raise ValueError(f"damping must be > 0, got {damping}")
        out = {name: grads[name].to(WIDE) / (d + damping) ** power
               for name, d in self.diagonal.items()}
        for name, layer in self.layers.items():
            basis = self.bases[name]
            g = basis.rotate(joined(grads, layer).to(WIDE))
            solved = basis.back(g / (self.eigenvalues(name, kind) + damping) ** power)
            out.update(split(solved, layer, grads[layer.weight].shape))
        return out


def joined(grads: Tensors, layer: Linear) -> torch.Tensor:
    """A layer's gradients ``[n, rows, columns]``: the weight's, its bias a last column (a
    last row where the weight is transposed)."""
    w = grads[layer.weight]
    w = w.reshape(len(w), w.shape[1], -1)
    if layer.bias is None:
        return w
    b = grads[layer.bias].reshape(len(w), 1, -1)
    return torch.cat([w, b], dim=1) if layer.transposed else torch.cat([w, b.mT], dim=2)


def split(g: torch.Tensor, layer: Linear, shape: torch.Size) -> Tensors:
    """:func:`joined`'s inverse: ``{weight: [n, *shape], bias: [n, out]}``."""
    if layer.bias is None:
        return {layer.weight: g.reshape(shape)}
    if layer.transposed:
        return {layer.weight: g[:, :-1].reshape(shape), layer.bias: g[:, -1]}
    return {layer.weight: g[:, :, :-1].reshape(shape), layer.bias: g[:, :, -1]}


def linear_layers(model: LoadedModel, params: Sequence[str], loss: str, gamma: float,
                  samples: Tensors) -> dict[str, Linear]:
    """The linear layers whose weight is among ``params`` (``nn.Linear`` modules, an exported
    graph's ``aten.linear`` and ``aten.addmm`` nodes), by weight name: those whose captured
    inputs and output gradients rebuild their gradient on the batch's first sample. A layer
    whose weight its parent reads directly (``nn.MultiheadAttention``'s ``out_proj``) or shares
    with another (a head tied to an embedding) is left to the diagonal."""
    found = _candidates(model, params)
    first = {k: v[:1] for k, v in samples.items()}
    for one in captured(model, loss, gamma, found, params, first):
        g = {k: v.unsqueeze(0) for k, v in one.grads.items()}
        return {name: layer for name, layer in found.items()
                if _rebuilds(one.out_grads[name].T @ one.inputs[name], joined(g, layer)[0])}
    return {}


_LINEAR = torch.ops.aten.linear.default
_ADDMM = torch.ops.aten.addmm.default


def _candidates(model: LoadedModel, params: Sequence[str]) -> dict[str, Linear]:
    """The linear layers whose weight is among ``params``, by weight name: ``nn.Linear``
    modules, and an exported graph's ``aten.linear`` and plain ``aten.addmm`` nodes (``bias +
    x @ w``) reading a weight of the program (each weight read one way only)."""
    chosen = set(params)
    found = {}
    for prefix, module in model.module.named_modules():
        weight = f"{prefix}.weight" if prefix else "weight"
        if isinstance(module, nn.Linear) and weight in chosen:
            bias = bias_of(weight)
            found[weight] = Linear(weight, bias if module.bias is not None and bias in chosen
                                   else None)
    graph = getattr(model.module, "graph", None)
    if not isinstance(graph, fx.Graph):
        return found
    read: dict[str, set[Linear]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (_LINEAR, _ADDMM):
            continue
        args = named_args(node.target, node.args, node.kwargs)
        if node.target is _ADDMM and (args.get("beta", 1) != 1 or args.get("alpha", 1) != 1):
            continue
        w, b = (args["weight"], args.get("bias")) if node.target is _LINEAR else (
            args["mat2"], args["self"])
        read_w, read_b = _attribute(w), _attribute(b)
        if read_w in chosen and model.params[read_w].dim() == 2:
            bias = bias_of(read_w)
            read.setdefault(read_w, set()).add(Linear(
                read_w, bias if read_b == bias and bias in chosen else None,
                transposed=node.target is _ADDMM))
    return found | {w: layer for w, (layer, *more) in read.items() if not more}


def bias_of(weight: str) -> str:
    """The name of a linear layer's bias beside its weight's (``fc.weight``: ``fc.bias``); a
    bias named otherwise is left to the diagonal, and a store's factors file reads it so."""
    return weight.removesuffix("weight") + "bias"


def _attribute(node: Any) -> str | None:
    """The program's tensor a graph node reads (a ``get_attr``), by its dotted name."""
    return str(node.target) if isinstance(node, fx.Node) and node.op == "get_attr" else None


def factor_numel(model: LoadedModel, params: Sequence[str]) -> int:
    """At most how many values the ``kfac_inputs`` output and its fields hold: ``(in + 1)^2 +
    out^2 + 1`` per linear layer of ``params``."""
    total = 0
    for name, layer in _candidates(model, params).items():
        rows, columns = model.params[name].shape[0], model.params[name][0].numel()
        bias = layer.bias is not None
        total += (columns + (bias and not layer.transposed)) ** 2 \
            + (rows + (bias and layer.transposed)) ** 2 + 1
    return total


def _rebuilds(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = float(want.abs().max()) if want.numel() else 0.0
    return bool((got - want).abs().max() <= 1e-4 * scale + 1e-12) if got.numel() else False


@dataclass(frozen=True)
class Sample:
    """One sample's gradients ``{param: [*shape]}`` and, per linear layer, its inputs ``[T,
    in (+1)]`` and output gradients ``[T, out]`` (``T``: every token of every call)."""

    grads: Tensors
    inputs: dict[str, torch.Tensor]
    out_grads: dict[str, torch.Tensor]


def captured(model: LoadedModel, loss: str, gamma: float, layers: dict[str, Linear],
             params: Sequence[str], samples: Tensors, weights: Tensors | None = None
             ) -> Iterator[Sample]:
    """Each sample of ``samples`` (a batch's fields, ``[n, ...]`` each) run alone through the
    model with plain autograd: its gradients and its linear layers' inputs and output gradients
    (:class:`_Calls`). It runs a copy of the module (sharing its tensors): ``functional_call``
    swaps the parameters of the module it runs, and the engine's lock is not held here."""
    frozen = {**model.params, **(weights or {})}
    sample_loss = sample_loss_of(replace(model, module=_shallow_copy(model.module)), loss, gamma)
    n = len(next(iter(samples.values())))
    with _Calls(layers) as calls:
        for i in range(n):
            selected = {k: frozen[k].detach().requires_grad_(True) for k in params}
            others = {k: v for k, v in frozen.items() if k not in selected}
            calls.watch(selected)
            value, _ = sample_loss(selected, others, model.buffers,
                                   {k: v[i] for k, v in samples.items()})
            outs = [y for _, _, y in calls.seen]
            found = torch.autograd.grad(value, [*selected.values(), *outs], allow_unused=True)
            grads = {k: torch.zeros_like(v) if g is None else g
                     for (k, v), g in zip(selected.items(), found, strict=False)}
            yield Sample(grads, *_layer_rows(model, layers, calls.seen, found[len(selected):]))


Call = tuple[str, torch.Tensor, torch.Tensor]  # a layer's call: (weight name, input, output)


def _layer_rows(model: LoadedModel, layers: dict[str, Linear], calls: list[Call],
                grads: Sequence[torch.Tensor | None]
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each layer's input rows ``[T, in (+1)]`` and output gradient rows ``[T, out]`` over its
    ``calls`` (``grads``: the loss's gradient by each call's output; None: it did not reach
    it), swapped for a transposed layer (:class:`Linear`); the layers that did not run with no
    rows."""
    inputs: dict[str, list[torch.Tensor]] = {k: [] for k in layers}
    out_grads: dict[str, list[torch.Tensor]] = {k: [] for k in layers}
    for (name, a, y), g in zip(calls, grads, strict=True):
        layer = layers[name]
        a = _with_ones(a.reshape(-1, a.shape[-1]), layer)
        g = (torch.zeros_like(y) if g is None else g).reshape(-1, y.shape[-1])
        inputs[name].append(g if layer.transposed else a)
        out_grads[name].append(a if layer.transposed else g)
    return ({k: _cat(v, model.params[k], layers[k], columns=True) for k, v in inputs.items()},
            {k: _cat(v, model.params[k], layers[k], columns=False) for k, v in out_grads.items()})


def _cat(parts: list[torch.Tensor], w: torch.Tensor, layer: Linear, columns: bool
         ) -> torch.Tensor:
    """A sample's rows of one side of a layer (none where the layer did not run)."""
    if parts:
        return torch.cat(parts)
    bias = layer.bias is not None and layer.transposed != columns
    return w.new_zeros(0, (w[0].numel() if columns else w.shape[0]) + bias)


def covariances(model: LoadedModel, loss: str, gamma: float, layers: dict[str, Linear],
                params: Sequence[str], samples: Tensors, weights: Tensors | None = None,
                at_once: bool = True) -> Covariances:
    """The first pass over one batch: :class:`Covariances` (the whole batch at once where the
    loss has a batched form, :func:`_at_once`; else, or not ``at_once``, one sample at a
    time, as ``verify`` recomputes it)."""
    whole = _at_once(model, loss, layers, params, samples, weights) if at_once else None
    if whole is not None:
        return whole
    sums = Covariances()
    for one in captured(model, loss, gamma, layers, params, samples, weights):
        sums.add(_summed(one.inputs, one.out_grads, 1))
    return sums


def _summed(inputs: dict[str, torch.Tensor], out_grads: dict[str, torch.Tensor], samples: int
            ) -> Covariances:
    """:class:`Covariances` of layer rows (:func:`_layer_rows`) of ``samples`` samples."""
    return Covariances({k: _gram(a.T) for k, a in inputs.items()},
                       {k: _gram(g.T) for k, g in out_grads.items()},
                       {k: len(a) for k, a in inputs.items()}, samples)


def _at_once(model: LoadedModel, loss: str, layers: dict[str, Linear], params: Sequence[str],
             samples: Tensors, weights: Tensors | None) -> Covariances | None:
    """The first pass in one forward and one backward of the batch's summed losses: the
    samples are independent (eval mode), so each token's output gradient is its own sample's,
    and the sums over samples of ``a a^T`` and ``g g^T`` are the whole batch's. None where
    the loss has no batched form or the model runs one sample at a time."""
    rows_loss = LOSSES[loss].batched
    if rows_loss is None or not model.batched:
        return None
    frozen = {**model.params, **(weights or {})}
    live = {k: v.detach().requires_grad_(True) if k in params else v for k, v in frozen.items()}
    named = [NAMED_INPUT + spec.name for spec in model.inputs[1:]]
    with _Calls(layers) as calls:
        calls.watch(live)
        out = functional_call(_shallow_copy(model.module), (live, model.buffers),
                              (samples["inputs"], *(samples[k] for k in named)))
        found = rows_loss(out, samples)
        if found is None:
            return None
        outs = [y for _, _, y in calls.seen]
        grads = torch.autograd.grad(found[0].sum(), outs, allow_unused=True) if outs else ()
        return _summed(*_layer_rows(model, layers, calls.seen, grads), len(out))


def _with_ones(a: torch.Tensor, layer: Linear) -> torch.Tensor:
    """A layer's input rows, each with a 1 at its end where its bias is selected."""
    if layer.bias is None:
        return a
    return torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype, device=a.device)], 1)


def factor_means(model: LoadedModel, loss: str, gamma: float, params: Sequence[str],
                 samples: Tensors, weights: Tensors | None = None, at_once: bool = True
                 ) -> tuple[Tensors, Tensors, Tensors]:
    """The ``kfac_inputs`` output and its two fields of one batch: per linear layer, by weight
    name, the means over samples of ``sum_t a a^T``, of ``sum_t g g^T`` and of the tokens."""
    layers = linear_layers(model, params, loss, gamma, samples)
    sums = covariances(model, loss, gamma, layers, params, samples, weights, at_once)
    n = max(sums.samples, 1)
    return ({k: v / n for k, v in sums.inputs.items()},
            {k: v / n for k, v in sums.grads.items()},
            {k: torch.tensor(t / n, dtype=WIDE) for k, t in sums.tokens.items()})


def corrections(model: LoadedModel, loss: str, gamma: float, layers: dict[str, Linear],
                params: Sequence[str], samples: Tensors, found: dict[str, Basis],
                weights: Tensors | None = None) -> Corrections:
    """The second pass over one batch, in the bases of the first: :class:`Corrections`."""
    sums = Corrections()
    for one in captured(model, loss, gamma, layers, params, samples, weights):
        sums.add(corrections_of(layers, found, {k: v.unsqueeze(0) for k, v in
                                                one.grads.items()}))
    return sums


def corrections_of(layers: dict[str, Linear], found: dict[str, Basis], grads: Tensors
                   ) -> Corrections:
    """The second pass's sums over per-sample gradients ``{param: [n, *shape]}`` already
    computed: :func:`rotated_squares`, and every other parameter's ``sum_i g_i^2``."""
    inside = covered(layers)
    return Corrections(rotated_squares(layers, found, grads),
                       {k: v.to(WIDE).square().sum(0) for k, v in grads.items()
                        if k not in inside}, len(next(iter(grads.values()))))


def rotated_squares(layers: dict[str, Linear], found: dict[str, Basis], grads: Tensors
                    ) -> dict[str, torch.Tensor]:
    """Per layer, ``sum_i (Q_S^T G_i Q_A)^2`` over per-sample gradients ``{param: [n,
    *shape]}``: EK-FAC's eigenvalues, times ``n``, in the bases ``found``."""
    return {k: found[k].rotate(joined(grads, layer).to(WIDE)).square().sum(0)
            for k, layer in layers.items()}


def covered(layers: dict[str, Linear]) -> set[str]:
    """The parameters ``layers`` precondition: their weights and selected biases."""
    return {p for layer in layers.values() for p in (layer.weight, layer.bias) if p}


def fit(model: LoadedModel, loss: str, gamma: float, params: Sequence[str],
        batches: Iterable[Tensors]) -> Curvature:
    """The :class:`Curvature` of ``params`` over the fitting ``batches`` (read twice)."""
    batches = list(batches)
    layers = linear_layers(model, params, loss, gamma, batches[0])
    sums = Covariances()
    for batch in batches:
        sums.add(covariances(model, loss, gamma, layers, params, batch))
    found = bases(sums)
    second = Corrections()
    for batch in batches:
        second.add(corrections(model, loss, gamma, layers, params, batch, found))
    return curvature(layers, found, second)


def curvature(layers: dict[str, Linear], found: dict[str, Basis], sums: Corrections
              ) -> Curvature:
    """The :class:`Curvature` of both passes' sums."""
    n = max(sums.samples, 1)
    return Curvature(layers, found, {k: v / n for k, v in sums.layers.items()},
                     {k: v / n for k, v in sums.diagonal.items()}, sums.samples)


def _gram(x: torch.Tensor) -> torch.Tensor:
    x = x.to(WIDE)
    return x @ x.T


def _shallow_copy(module: nn.Module) -> nn.Module:
    """The module's structure copied, its parameters and buffers shared."""
    memo = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)


class _Calls(TorchFunctionMode):
    """Every call of a layer's op while open (``F.linear``, ``aten.linear``, ``aten.addmm``):
    ``seen``, ``(weight name, input, output)`` each, of the weights :meth:`watch` named.
    A torch function mode is the thread's own, so other jobs never see it; one op that calls
    another (``nn.MultiheadAttention`` its ``out_proj``) shows only the outer call."""

    def __init__(self, layers: dict[str, Linear]) -> None:
        super().__init__()
        self.layers = layers
        self.weights: dict[int, str] = {}
        self.seen: list[Call] = []

    def watch(self, tensors: Tensors) -> None:
        """The next forward's weights: ``tensors`` by name (what it is called with)."""
        self.weights = {id(tensors[k]): k for k in self.layers if k in tensors}
        self.seen = []

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        names = _OPS.get(func)
        if names is not None:
            x, w = bind(args, kwargs, names)[-2:]
            name = self.weights.get(id(w))
            if name is not None and isinstance(x, torch.Tensor):
                self.seen.append((name, x.detach(), out))
        return out


# each op's arguments up to its input and weight, the last two
_OPS = {F.linear: ("input", "weight"), _LINEAR: ("input", "weight"),
        _ADDMM: ("self", "mat1", "mat2")}
