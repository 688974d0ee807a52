"""``per_sample_grads``, ``td0`` and ``submit``, defined once for ``Client`` and ``AsyncClient``.

Each method builds its request with :func:`psgrad._request.grads_fields` (every field as the
request contract declares it) and hands the builder to ``_compute`` or ``_queue``, which
``Client`` implements by sending and ``AsyncClient`` by returning a coroutine: the async methods
are these, awaited. The builder runs inside them, so a refused request raises where the answer
would come (at ``await`` for the async client).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from psgrad._merge import Fields
from psgrad._request import grads_fields

if TYPE_CHECKING:
    from typing import Unpack

    from psgrad._base import ProgressArg
    from psgrad._contract import Options

__all__ = ["GradsMethods"]

R = TypeVar("R")  # what per_sample_grads and td0 return: a GradsResult, or a coroutine of one
J = TypeVar("J")  # what submit returns: a Job, or a coroutine of an AsyncJob
Build = Callable[[], Fields]
TD0_SETS = ("loss", "next_inputs", "rewards")  # td0 sets these from its own arguments


class GradsMethods(Generic[R, J]):
    """The gradient methods of both clients; the client supplies ``_compute`` and ``_queue``."""

    def _compute(self, build: Build, *, as_torch: bool, progress: ProgressArg,
                 chunk_size: int | None) -> R:
        raise NotImplementedError

    def _queue(self, build: Build) -> J:
        raise NotImplementedError

    def per_sample_grads(self, model: str, inputs: Any, targets: Any = None, *,
                         as_torch: bool = False, progress: ProgressArg = False,
                         chunk_size: int | None = None, **options: Unpack[Options]) -> R:
        """Per-sample gradients of ``model`` on a batch, or statistics of them
        (``AsyncClient``: the same, awaited).

        Args:
            model: a model id, or ``id@version`` to pin weights.
            inputs: the batch [B, ...]: a numpy array, a torch tensor or nested lists; floating
                arrays in the model's dtype (see ``Client``), integer ones (token ids) as they
                are. For a model with several inputs (``GET /models/{id}`` lists them), a dict
                ``{input name: array}``, e.g. ``{"input_ids": ids, "attention_mask": mask}``.
            targets: labels or regression targets [B, ...] for supervised losses.
            loss: ``cross_entropy``, ``nll``, ``mse``, ``next_token``, ...; default: the model's.
            outputs: any of ``grads``, ``losses``, ``norms``, ``layer_norms``, ``mean``,
                ``variance``, ``clipped_mean``, ``dot``, ``cosine_mean``, ``projection``,
                ``dots``, ``influence``, ``self_influence`` (``td_errors``, ``updates``: td0).
            params: restrict every output to these parameters.
            weights: {parameter: array} used for this call instead of the registered ones.
            mask: the token losses' [B, T] mask (the shape of ``targets``): 1 for the positions
                that count, 0 for padding.
            clip_norm, noise_multiplier, seed: for ``clipped_mean`` (DP-SGD).
            dp_run: a DP run's id (``psgrad.dp``): the request is one DP-SGD step of that run,
                sent whole (never split) and noised by the server.
            reference: {parameter: array} for ``dot``, or {parameter: [M, *shape]} for
                ``dots`` (exact dot products with M gradients).
            next_inputs, rewards, dones, gamma: loss ``td0`` (see :meth:`td0`).
            projection_dim, projection_seed: the sketch of ``projection`` (k up to 8192; the
                same seed and k give comparable sketches across requests and processes).
            projection_kind: ``tensorsketch`` (default: a dense projection's accuracy) or
                ``kronecker`` (the earlier kind, for sketches made with it).
            reference_sketches: [M, k] sketches for ``dots``, made with the same projection.
            reference_set: the id of a ``client.reference_sets`` set, for ``influence``.
            answer_dtype: ``float16`` or ``bfloat16``: the server answers floating tensors in
                half the bytes (relative rounding error at most 2^-11 / 2^-8); float16 arrays
                come back as float16, bfloat16 ones widened exactly to float32 (numpy has no
                bfloat16).
            autocast: ``bfloat16``: the model's forward and backward run under
                ``torch.autocast`` in bfloat16, as a mixed-precision training step does (float32
                models); the statistics agree with float32's to bfloat16's precision.
            verify, verify_seed: the server recomputes ``verify`` samples of each request
                (up to 64; the batch may be split into several) one at a time with the
                per-sample loop and compares the outputs: ``result.meta["verify"]`` reports the
                samples (indices into this batch) and the largest difference, and a wrong answer
                raises ``VerificationFailed`` instead of being returned. ``verify_seed`` picks
                the samples (default: each request's job id).
            as_torch: return torch tensors instead of numpy arrays.
            progress: draw a progress bar on stderr (tqdm if installed), or a callable
                ``f(done, total)`` called after each request.
            chunk_size: the most samples per request; default: the client's
                ``max_batch_size``, else what the server accepts.

        The keyword options are the fields of the request contract (``psgrad._contract``),
        each as the server documents it in ``/docs``.

        A batch larger than one request may hold is split into chunks and combined exactly:
        per-sample outputs are concatenated; ``mean`` and ``variance`` merged with Chan's
        formula; ``clipped_mean`` as the sum of the chunks' noiseless clipped sums with the
        noise added once by the client (seeded with ``seed``; drawn by the client even for one
        chunk, so the result never depends on the split); ``cosine_mean`` in two passes (the
        chunks' means first, then ``dot`` with the combined mean and the norms). See
        :mod:`psgrad._merge`.

        Returns:
            A :class:`GradsResult`: ``result.norms``, ``result.grads["fc1.weight"]``, ...

        Raises:
            PsgradError: the subclass of the server's error code (``UnknownModel``,
                ``ShapeMismatch``, ...), or ``APIConnectionError`` if it cannot be reached.
        """
        build = functools.partial(grads_fields, model, inputs, targets, **options)
        return self._compute(build, as_torch=as_torch, progress=progress, chunk_size=chunk_size)

    def td0(self, model: str, states: Any, rewards: Any, next_states: Any, /, *,
            as_torch: bool = False, progress: ProgressArg = False, chunk_size: int | None = None,
            **options: Unpack[Options]) -> R:
        """Per-sample TD(0) of a value function: ``updates`` (delta_i grad V(s_i)), ``td_errors``.

        target_i = r_i + gamma (1 - done_i) V(s'_i), gradient stopped through it;
        delta_i = target_i - V(s_i). ``dones`` (default all 0) and ``gamma`` (default 1.0) are
        options, as is every other option of :meth:`per_sample_grads`; ``outputs`` defaults to
        ``["updates", "td_errors"]``, and ``grads`` (of the pseudo-loss (target_i - V(s_i))^2)
        and every statistic may be asked for too. Large batches are split and combined the
        same way.
        """
        taken = [k for k in TD0_SETS if k in options]
        if taken:
            raise TypeError(f"td0 sets {', '.join(taken)} itself (loss td0; rewards and "
                            "next_states are its arguments)")
        fields: dict[str, Any] = {"outputs": ("updates", "td_errors"), **options}
        build = functools.partial(grads_fields, model, states, loss="td0", rewards=rewards,
                                  next_inputs=next_states, **fields)
        return self._compute(build, as_torch=as_torch, progress=progress, chunk_size=chunk_size)

    def submit(self, model: str, inputs: Any, targets: Any = None,
               **options: Unpack[Options]) -> J:
        """Queue the request (``POST /jobs``) and return at once with a job handle
        (``AsyncClient``: awaited, an ``AsyncJob``).

        The options are those of :meth:`per_sample_grads`. A job is one request: it is not
        split, so a batch above the server's limit raises ``TooLarge``; the server's own noise
        is used for ``clipped_mean``. It goes under an ``Idempotency-Key`` of its own, so it is
        sent again after a lost answer and queued once.
        """
        return self._queue(functools.partial(grads_fields, model, inputs, targets, **options))
