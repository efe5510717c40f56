"""BatchSteps coded once and sent many times: a decode loop over shared-memory regions.

A model that decodes a batch of sequences with its inputs and outputs in registered regions sends,
for every layer of every token, the same BatchStep but for the layer: the same sessions, the same
region slices for q, k_new, v_new, o (and lse). ``client.prepare_batch_step(items)`` codes that
request once, with each step's layer written as a fixed-width varint (protobuf reads a padded
varint as the same value); the message of a layer is those bytes with the layers rewritten at
their fixed places, made at its first call and kept, and each call sends it as it is. The answer is checked with one pass
over its bytes (every item OK, every o in its region); any other answer (a failed item) is read
in full, so errors are those of ``client.batch_step``, item by item.

    prepared = client.prepare_batch_step(
        [attnd.StepItem(s, 0, q[i], k[i], v[i], out=o[i]) for i, s in enumerate(sessions)])
    for layer in range(num_layers):
        ...                                   # write q, k, v of this layer into the region
        prepared.step(layer)                  # o now holds attention's output

Every q, k_new, v_new and out (and lse_out with return_lse) must lie in a region registered with
the client (InvalidArgument at preparation otherwise); the sessions and slices are fixed, while
the region's contents change freely between calls.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence as SequenceABC
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union, overload

from . import _core, _tensors, _wire
from .errors import AttndError, BatchStepError, InvalidArgument
from .regions import RegionTable

Layers = Union[None, int, Sequence[int]]

# Messages kept per template, one per layer value sent (a model has one per layer).
_CACHED_LAYERS = 1024


def _region_step(regions: RegionTable, item: _core.StepItem, index: int
                 ) -> Tuple[str, int, bytes, _core.Prepared, int]:
    """One item's StepRequest parts (layer written at fixed width) and what reading needs."""
    what = f"item {index}"
    ps, placed, device = _core._inputs(regions, item.q, item.k_new, item.v_new,
                                       ("q", "k_new", "v_new"))
    for name, p, at in zip(("q", "k_new", "v_new"), ps, placed):
        if at is None:
            raise InvalidArgument(f"prepare_batch_step: {what}: {name} is empty or does not lie in "
                                  "a region registered with this client (a prepared BatchStep "
                                  "sends region slices only)")
    if item.out is None:
        raise InvalidArgument(f"prepare_batch_step: {what}: out is needed (a slice of a "
                              "registered region for o)")
    if item.return_lse and item.lse_out is None:
        raise InvalidArgument(f"prepare_batch_step: {what}: return_lse needs lse_out (a slice of a "
                              "registered region)")
    outputs, o_in, lse_in = _core._outputs(regions, item.out, item.lse_out)
    for name, x, inside in (("out", item.out, o_in), ("lse_out", item.lse_out, lse_in)):
        if x is not None and not inside:
            raise InvalidArgument(f"prepare_batch_step: {what}: {name} does not lie in a region "
                                  "registered with this client")
    layer = int(item.layer)
    sid = _core.session_id_of(item.session)
    m = _wire.step_request(sid, layer, ps[0], ps[1], ps[2], placed, float(item.scale or 0.0),
                           item.return_lse, _core._window(item.window), outputs,
                           layer_width=_wire.LAYER_WIDTH)
    body = b"".join(m.parts)
    p = _core.Prepared(b"", _tensors.OutputMaker(item.q), item.out, item.lse_out, True,
                       item.lse_out is not None, device)
    return sid, layer, body, p, _tensors.payload(item.out, "out").nbytes


class BatchStepTemplate:
    """The coded BatchStep of a fixed list of steps in regions, and the reading of its answers
    (no I/O: PreparedBatchStep and aio's AsyncPreparedBatchStep send it). Safe to share between
    threads (nothing is rewritten in place after it is made).

    Attributes: ``session_ids`` and ``layers`` (as prepared), ``devices`` (CUDA devices whose
    current stream is synchronized before each call: those of GPU-region inputs).
    """

    def __init__(self, regions: RegionTable, items: Sequence[Any]):
        if not items:
            raise InvalidArgument("prepare_batch_step: no items")
        self.session_ids: List[str] = []
        self.layers: List[int] = []
        self.prepared: List[_core.Prepared] = []
        self._layer_at: List[int] = []
        head = bytearray()
        o_bytes = None
        devices = set()
        for i, raw in enumerate(items):
            sid, layer, body, p, o_nbytes = _region_step(regions, _core.as_step_item(raw), i)
            head += _wire._tag(_wire.BATCH_STEPS, _wire._LEN) + _wire.varint(len(body))
            self._layer_at.append(len(head) + _wire.layer_offset(sid))
            head += body
            self.session_ids.append(sid)
            self.layers.append(layer)
            self.prepared.append(p)
            o_bytes = o_nbytes if o_bytes is None else min(o_bytes, o_nbytes)
            if p.cuda_sync is not None:
                devices.add(p.cuda_sync)
        self.devices = sorted(devices)
        self._o_bytes = o_bytes or 0
        self._initial = bytes(head)
        self._by_layer: Dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self.prepared)

    def message(self, layer: Layers = None) -> bytes:
        """The request's bytes with every step at `layer` (an int), each step at its own
        (a sequence, one per item), or at the layers it was prepared with (None)."""
        if layer is None:
            return self._initial
        if not isinstance(layer, int) and not isinstance(layer, SequenceABC) and \
                hasattr(layer, "__index__"):
            layer = operator.index(layer)  # a numpy or torch integer
        if isinstance(layer, int):
            m = self._by_layer.get(layer)
            if m is None:
                m = self._write([layer] * len(self._layer_at))
                if len(self._by_layer) >= _CACHED_LAYERS:
                    self._by_layer.clear()
                self._by_layer[layer] = m
            return m
        layers = [int(x) for x in layer]
        if len(layers) != len(self._layer_at):
            raise InvalidArgument(f"{len(layers)} layers for a prepared BatchStep of "
                                  f"{len(self._layer_at)} steps")
        return self._write(layers)

    def _write(self, layers: Sequence[int]) -> bytes:
        # A copy each time, so that threads sending one template at different layers do not
        # rewrite each other's bytes (a layer's message is then kept).
        buf, width = bytearray(self._initial), _wire.LAYER_WIDTH
        for at, layer in zip(self._layer_at, layers):
            buf[at:at + width] = _wire.fixed_varint(int(layer), width)
        return bytes(buf)

    def read(self, buf: bytes, return_exceptions: bool) -> "BatchStepResults":
        """The results of an answer: checked in one pass when every step succeeded with its o in
        its region, else read in full (raising BatchStepError for failed items unless
        return_exceptions, as Client.batch_step does)."""
        if _wire.all_steps_in_regions(buf, len(self.prepared), self._o_bytes):
            return BatchStepResults(buf, self.prepared, None)
        results = _core.read_batch_step(buf, self.prepared)
        if not return_exceptions and any(isinstance(r, AttndError) for r in results):
            raise BatchStepError(results)
        return BatchStepResults(buf, self.prepared, results)

    def synchronize(self) -> None:
        """Makes the device work that wrote GPU-region inputs complete (attnd reads them from
        another process)."""
        for device in self.devices:
            _core.cuda_synchronize(device)


class BatchStepResults(SequenceABC):
    """The outcome of a prepared BatchStep: a sequence of StepResult (or, with return_exceptions,
    AttndError), in the order of the items. Each StepResult's o (and lse) is the item's ``out``
    (``lse_out``), written by attnd. Read from the answer's bytes when first looked at."""

    __slots__ = ("_buf", "_prepared", "_results")

    def __init__(self, buf: bytes, prepared: List[_core.Prepared], results: Optional[List[Any]]):
        self._buf = buf
        self._prepared = prepared
        self._results = results

    def _all(self) -> List[Any]:
        if self._results is None:
            self._results = _core.read_batch_step(self._buf, self._prepared)
            self._buf = b""
        return self._results

    def __len__(self) -> int:
        return len(self._prepared)

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> List[Any]: ...

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._all())

    @property
    def cached_tokens(self) -> List[int]:
        """Tokens in each item's layer cache after the step (0 for a failed item)."""
        return [r.cached_tokens if isinstance(r, _core.StepResult) else 0 for r in self._all()]

    def __repr__(self) -> str:
        return f"BatchStepResults({len(self)} steps)"


class _Prepared:
    """What the sync and asyncio prepared BatchSteps share: the template and its steps."""

    def __init__(self, client: Any, template: BatchStepTemplate):
        self.client = client
        self.template = template
        self.session_ids = template.session_ids
        self.layers = template.layers

    def __len__(self) -> int:
        return len(self.template)


class PreparedBatchStep(_Prepared):
    """A BatchStep coded once for a fixed list of steps whose tensors lie in registered regions
    (``Client.prepare_batch_step``); ``step(layer)`` sends it. See the module's description.

    Attributes: ``session_ids``, ``layers`` (as prepared), ``client``.
    """

    def step(self, layer: Layers = None, *, timeout: Optional[float] = None,
             return_exceptions: bool = False) -> BatchStepResults:
        """Sends the BatchStep: every step at `layer` (an int), each at its own (one per item), or
        at the layers it was prepared with (None). Synchronizes the current CUDA stream of
        GPU-region inputs first. Returns the results (o and lse are in the items' out and
        lse_out); a failed item raises BatchStepError (its ``results`` hold every item's
        outcome) unless return_exceptions, as Client.batch_step. Not resent on UNAVAILABLE."""
        t = self.template
        message = t.message(layer)
        if t.devices:
            t.synchronize()
        buf = self.client._unary("BatchStep", message, self.client._timeout(timeout))
        return t.read(buf, return_exceptions)

    __call__ = step

    def __repr__(self) -> str:
        return f"PreparedBatchStep({len(self)} steps)"


class AsyncPreparedBatchStep(_Prepared):
    """asyncio twin of PreparedBatchStep (``attnd.aio.Client.prepare_batch_step``); ``await
    prepared.step(layer)``. The GPU synchronization before the call blocks the event loop for as
    long as the stream's queued work takes."""

    async def step(self, layer: Layers = None, *, timeout: Optional[float] = None,
                   return_exceptions: bool = False) -> BatchStepResults:
        """See PreparedBatchStep.step."""
        t = self.template
        message = t.message(layer)
        if t.devices:
            t.synchronize()
        buf = await self.client._unary("BatchStep", message, self.client._timeout(timeout))
        return t.read(buf, return_exceptions)

    __call__ = step

    def __repr__(self) -> str:
        return f"AsyncPreparedBatchStep({len(self)} steps)"
