"""Large-batch training on one device (FastAP paper, section "Large-Batch Training").

A loss such as FastAP does not decompose over samples, so a batch cannot be split into
independent pieces. But the loss only needs the embedding matrix, which is small: embed
the batch chunk by chunk without a graph, take the gradient of the loss with respect to
the embedding matrix, then embed each chunk again with a graph and back-propagate its
rows of that gradient. The parameter gradients are exactly those of the full batch, while
activation memory is that of one chunk.

Works with any callable ``loss_func(embeddings, labels, indices_tuple)``: every pml-rank
loss and every PML loss, including losses with parameters (their gradients are
accumulated too) and losses with a memory (the loss is called once per step).

Caveat: layers whose output depends on the other samples of the batch, above all
BatchNorm in training mode, see chunk statistics instead of full-batch statistics, and
update their running statistics twice per chunk. Freeze them (PML trainers:
``freeze_trunk_batchnorm=True``) or use a model without them.
"""

import warnings

import torch
from pytorch_metric_learning.trainers import MetricLossOnly

from ._checks import check_type


def large_batch_backward(embed, loss_func, data, labels, chunk_size, miner=None):
    """Back-propagate ``loss_func`` over a batch too large to embed with a graph at once.

    Args:
        embed: maps a chunk of `data` (``data[i:j]``) to its embeddings, e.g. a model.
        loss_func: called once as ``loss_func(embeddings, labels, indices_tuple)``.
        data: the batch, sliced along its first dimension.
        labels: labels of the whole batch.
        chunk_size: number of samples embedded with a graph at a time.
        miner: optional, called once as ``miner(embeddings, labels)``; its output is
            the `indices_tuple`.

    Accumulates gradients into the parameters of `embed` and `loss_func` (like
    ``loss.backward()``; zero them yourself) and returns the loss, detached.
    Random layers (dropout) see the same random numbers in both passes over a chunk.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"large_batch_backward: chunk_size must be a positive integer, got {chunk_size!r}")
    starts = range(0, len(data), chunk_size)
    rng_states = []
    with torch.no_grad():
        chunks = []
        for start in starts:
            rng_states.append(_rng_state())
            chunks.append(embed(data[start : start + chunk_size]))
    after_first_pass = _rng_state()
    embeddings = torch.cat(chunks).requires_grad_()
    del chunks

    indices_tuple = miner(embeddings, labels) if miner is not None else None
    loss = loss_func(embeddings, labels, indices_tuple)
    if not (torch.is_tensor(loss) and loss.requires_grad):
        return loss.detach() if torch.is_tensor(loss) else torch.as_tensor(loss)  # nothing to learn
    loss.backward()  # also reaches the loss's own parameters, if any
    grad = embeddings.grad
    if grad is None:  # the loss does not depend on the embeddings
        return loss.detach()

    for start, rng in zip(starts, rng_states):
        _set_rng_state(rng)
        chunk = embed(data[start : start + chunk_size])
        chunk.backward(grad[start : start + chunk_size].to(chunk.dtype))
    _set_rng_state(after_first_pass)
    return loss.detach()


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class LargeBatchMetricLossOnly(MetricLossOnly):
    """PML's `MetricLossOnly` trainer with the large-batch scheme: `batch_size` can be far
    larger than what fits on the device with a graph; trunk and embedder run with a graph
    on `chunk_size` samples at a time. Everything else (miners, loss weights, hooks,
    optimizers, gradient clippers) is PML's.

        trainer = LargeBatchMetricLossOnly(models, optimizers, batch_size=4096,
                                           loss_funcs={"metric_loss": FastAPLoss()},
                                           dataset=dataset, chunk_size=256)
    """

    def __init__(self, *args, chunk_size, **kwargs):
        check_type(type(self).__name__, "chunk_size", chunk_size, int)
        if chunk_size < 1:
            raise ValueError(f"{type(self).__name__}: chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self._checked_batchnorm = False
        super().__init__(*args, **kwargs)

    def calculate_loss(self, curr_batch):
        data, labels = curr_batch
        self._warn_about_training_batchnorm()
        weight = self.loss_weights.get("metric_loss", 0)
        if weight <= 0:
            self.losses["metric_loss"] = 0
            return

        def weighted_loss(embeddings, labels, indices_tuple):
            return weight * self.maybe_get_metric_loss(embeddings, labels, indices_tuple)

        loss = large_batch_backward(
            self.compute_embeddings,
            weighted_loss,
            data,
            labels,
            self.chunk_size,
            miner=self.mining_funcs.get("tuple_miner"),
        )
        # The loss tracker multiplies by the weight again for the total.
        self.losses["metric_loss"] = loss / weight

    def backward(self):
        """The gradients were back-propagated chunk by chunk in calculate_loss."""

    def _warn_about_training_batchnorm(self):
        if self._checked_batchnorm:
            return
        self._checked_batchnorm = True
        training = [
            f"{name}.{layer_name}"
            for name, model in self.models.items()
            for layer_name, layer in model.named_modules()
            if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) and layer.training
        ]
        if training:
            warnings.warn(
                f"LargeBatchMetricLossOnly: BatchNorm layers in training mode ({', '.join(training)}) "
                f"normalise each chunk of {self.chunk_size} with its own statistics, not the "
                "batch's, and update their running statistics twice per chunk; consider "
                "freeze_trunk_batchnorm=True",
                stacklevel=2,
            )
