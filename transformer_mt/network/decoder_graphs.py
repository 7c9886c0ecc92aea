"""The decoder's step over fixed shapes, recorded as a CUDA graph and replayed (decode.cuda_graphs).

On a GPU a search step is bound by its host: on an H200 a step of 2,214 rows took 7.56 ms, its
kernels busy 30 % of it, ~250 launches (docs/benchmarks.md). A graph replays a recorded step's
kernels in one launch, but it records fixed shapes and fixed addresses, where DecoderCache grows a
position each step and drops the rows of finished sentences. Here the step's tensors live in
buffers of a fixed shape, a *key* (sentences, rows a sentence, positions):

- positions: the self-attention cache holds a power of two of them (at least 16); this step's
  key and value are written at its position (index_copy_ at a position held on the device), and
  the positions not yet decoded are masked out (DecoderCache.past_mask);
- sentences: the buffers hold a bucket of them: the batch's count, then an eighth of it, a
  64th..., the smallest that holds the live ones; live rows come first, the rows after
  them are computed and never read;
- rows a sentence: 1 at the first step of a beam search, k after it.

A key holds for a run of steps: positions only grow and sentences only leave, so a key once
left never comes back. Each key's step is recorded once (at its first step; the search's very
first step runs eagerly) and replayed until the key changes; the buffers are then made anew at
the new key's shape, the live part copied over. Estimated from the lengths of the GPU bench's
10,000 Multi30k lines (beam 5, 32,768-token batches): a batch of ~33 steps has ~6 keys, and it
computes 1.18x the live rows (buckets of a quarter: ~7 keys, 1.14x; a recording costs about an
eager step of the host's time, a replay's rows a little kernel time).

The step is the model's own layers (DecoderLayer.forward with this cache); the embedding's
position is read from the device, and the output projection writes its logits into a buffer
outside the graph's memory, normalised by the search's step after the replay. The search keeps
its sentences in their order (search.SearchState), so a reorder is the surviving rows gathered
into the front of the buffers, and, when sentences finished, their cross-attention K/V and
source mask too.

Beam search records more than this step: beam_graphs.py makes its whole step one graph over
these buffers. Without recording (record=False, the CPU) the same step runs eagerly: the tests
compare it with DecoderCache's step on the CPU; tests/test_gpu.py compares the replayed step on
CUDA.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from transformer_mt.common import distributed
from transformer_mt.network.model import Transformer

logger = logging.getLogger(__name__)

SENTENCE_BUCKET_RATIO = 8  # each bucket of sentences an eighth of the one before
MIN_POSITIONS = 16


class FixedCache:
    """What a DecoderLayer reads of a cache (DecoderCache's beam, cross_k, cross_v, past_mask,
    append), in buffers of one key's shape: self-attention K/V (L, 2, rows, H, positions, K),
    cross-attention Kᵀ (L, sentences, H, K, S) and V (L, sentences, H, S, K), the source mask
    (sentences, 1, 1, S). `position` (1,), on the device, is the step's position; past_mask
    marks the positions up to it."""

    def __init__(self, model: Transformer, key: tuple[int, int, int], source: int,
                 like: torch.Tensor) -> None:  # fmt: skip
        sentences, self.beam, positions = key
        cfg = model.cfg
        heads, dim, layers = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.n_decoder_layers
        # Zeros, not empty: a masked position still meets its value in softmax(.) @ V (0 · V),
        # which must not be NaN.
        self.kv = like.new_zeros(layers, 2, sentences * self.beam, heads, positions, dim)
        self.cross_kt = like.new_zeros(layers, sentences, heads, dim, source)
        self.cross_values = like.new_zeros(layers, sentences, heads, source, dim)
        self.src_mask = torch.ones(sentences, 1, 1, source, dtype=torch.bool, device=like.device)
        self.tokens = torch.zeros(sentences * self.beam, dtype=torch.long, device=like.device)
        self.position = torch.zeros(1, dtype=torch.long, device=like.device)
        self.slots = torch.arange(positions, device=like.device)
        self.past_mask: torch.Tensor | None = None  # set by each step, inside its recording
        self.self_k = [kv[0] for kv in self.kv]  # per layer (rows, H, positions, K)
        self.self_v = [kv[1] for kv in self.kv]
        self.cross_k = [k.mT for k in self.cross_kt]  # (sentences, H, S, K), Kᵀ contiguous
        self.cross_v = list(self.cross_values)

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's k, v (rows, H, 1, K) written at `position`; the whole buffers back."""
        self.self_k[layer].index_copy_(2, self.position, k)
        self.self_v[layer].index_copy_(2, self.position, v)
        return self.self_k[layer], self.self_v[layer]


class DecoderGraphs:
    """The search's state and step over one batch (search.SearchState): step(tokens (N,)) ->
    log-probabilities (N, V) (logits where not `normalise`), float32, valid until the next step."""

    def __init__(
        self,
        model: Transformer,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        normalise: bool = True,
        record: bool = False,
    ) -> None:
        """memory (B, S, D) the encoded batch, src_mask (B, 1, 1, S); `record`: CUDA graphs
        (else the same step eagerly)."""
        self.model, self.normalise, self.record = model, normalise, record
        self.batch, self.source = memory.size(0), memory.size(1)
        self.length = 0  # positions decoded so far
        self.width = 1  # rows a sentence
        self.key = (self.batch, 1, MIN_POSITIONS)
        self.live = self.batch  # sentences not finished
        self.cache = FixedCache(model, self.key, self.source, memory)
        for i, layer in enumerate(model.decoder_layers):
            k, v = layer.cross_attn.project_key_value(memory)  # (B, H, S, K) each
            self.cache.cross_kt[i].copy_(k.mT)
            self.cache.cross_values[i].copy_(v)
        self.cache.src_mask.copy_(src_mask)
        self.logits = self._logits_buffer()  # (rows, V), outside any graph's memory
        self.graph: torch.cuda.CUDAGraph | None = None
        self.recorded = 0  # graphs recorded (one a key)
        self.recording_s = 0.0  # the host's time in recordings (what reusing them would save)
        self.replays = 0
        self.stream: torch.cuda.Stream | None = None  # where recordings are made, at the first
        self.pool = None  # the graphs' shared memory pool

    # --- the search's side ----------------------------------------------------------------

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = len(tokens)
        key = self._key(rows // self.width, self.width, self.length + 1)
        if key != self.key:
            self._refit(key, rows)
        self.cache.tokens[:rows].copy_(tokens)
        self.cache.position.fill_(self.length)
        # The first step runs eagerly: in beam search its key (one row a sentence) is never
        # seen again, and it warms up what a recording must not start (kernels, cuBLAS).
        if self.graph is None and self.length > 0 and self.can_record():
            self.graph = self._recorded()
        if self.graph is None:
            self._forward()
        else:
            self.graph.replay()
            self.replays += 1
        self.length += 1
        logits = self.logits[:rows].float()
        return F.log_softmax(logits, dim=-1) if self.normalise else logits

    def reorder(self, index: torch.Tensor, beam: int) -> None:
        """Keep rows `index` (B'·beam,), each `beam` from one sentence, sentences in order."""
        old = self.width
        self.width = beam
        sentences = index.view(-1, beam)[:, 0] // old  # (B',)
        if len(sentences) == self.live:  # the same sentences, in order
            sentences = None
        key = self._key(len(index) // beam, beam, self.length + 1)
        self._refit(key, len(index), index, sentences)

    def can_record(self) -> bool:
        """Whether steps are to be recorded: asked for, and no recording failed before."""
        return self.record and not _REFUSED

    # --- buffers ----------------------------------------------------------------------------

    def _key(self, sentences: int, beam: int, positions: int) -> tuple[int, int, int]:
        bucket = self.batch
        while bucket > 1 and math.ceil(bucket / SENTENCE_BUCKET_RATIO) >= sentences:
            bucket = math.ceil(bucket / SENTENCE_BUCKET_RATIO)
        room = max(MIN_POSITIONS, 1 << (positions - 1).bit_length())
        return bucket, beam, room

    def _refit(
        self,
        key: tuple[int, int, int],
        rows: int,
        index: torch.Tensor | None = None,
        sentences: torch.Tensor | None = None,
    ) -> None:
        """The buffers at `key`, holding the live part: the first `rows` rows (rows `index` of
        the old ones where given), their tokens where the buffers are new, and their sentences
        (`sentences` of the old ones)."""
        old, t = self.cache, self.length
        self.live = live = rows // self.width
        past = old.kv[:, :, :, :, :t]  # (L, 2, rows, H, t, K)
        past = past.index_select(2, index) if index is not None else past[:, :, :rows]
        if key == self.key:  # in place: the gathered rows over the old ones
            if index is not None:
                old.kv[:, :, :rows, :, :t].copy_(past)
            if sentences is not None:
                for buffer in (old.cross_kt, old.cross_values):
                    buffer[:, :live].copy_(buffer.index_select(1, sentences))
                old.src_mask[:live].copy_(old.src_mask.index_select(0, sentences))
            return
        new = FixedCache(self.model, key, self.source, old.kv)
        new.kv[:, :, :rows, :, :t].copy_(past)
        tokens = old.tokens.index_select(0, index) if index is not None else old.tokens[:rows]
        new.tokens[:rows].copy_(tokens)  # the next step's, where a search keeps them here
        pairs = ((new.cross_kt, old.cross_kt), (new.cross_values, old.cross_values),
                 (new.src_mask[None], old.src_mask[None]))  # fmt: skip
        for into, source in pairs:
            taken = source.index_select(1, sentences) if sentences is not None else source
            into[:, :live].copy_(taken[:, :live])
        self.cache, self.key = new, key
        self.logits = self._logits_buffer()
        self.graph = None  # a key left never comes back

    def _logits_buffer(self) -> torch.Tensor:
        weight = self.model.output_projection.weight  # (V, D)
        return weight.new_empty(len(self.cache.tokens), weight.size(0))

    # --- the step ---------------------------------------------------------------------------

    def _forward(self) -> None:
        """One decoder step over the key's rows: Transformer.decode with this cache, the
        position read from the device, the logits written into self.logits."""
        model, cache = self.model, self.cache
        embedding = model.embedding
        cache.past_mask = (cache.slots <= cache.position).view(1, 1, 1, -1)
        y = F.embedding(cache.tokens[:, None], embedding.weight) * embedding.scale
        y = embedding.dropout(y + embedding.positions.index_select(0, cache.position))
        for i, layer in enumerate(model.decoder_layers):
            y = layer(y, None, cache.src_mask, cache, i)  # (rows, 1, D)
        y = model.decoder_norm(y)[:, 0]
        projection = model.output_projection
        if projection.bias is None:
            torch.mm(y, projection.weight.t(), out=self.logits)
        else:
            torch.addmm(projection.bias, y, projection.weight.t(), out=self.logits)

    def _recorded(self, body: Callable[[], None] | None = None) -> torch.cuda.CUDAGraph | None:
        """The step at the current key (`body`, default the decoder's step), recorded (not run),
        or None where recording failed (logged once a process; decoding goes on eagerly). Its
        intermediates live in the graphs' shared pool (one graph alive at a time), its inputs
        and outputs outside it."""
        device, begin = self.logits.device, time.perf_counter()
        try:
            if self.stream is None:
                self.stream = torch.cuda.Stream(device)
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            self.stream.wait_stream(torch.cuda.current_stream(device))
            _clear_cublas_workspaces()  # made inside the recording, kept by its pool
            try:
                with torch.cuda.stream(self.stream):
                    # Not torch.cuda.graph: it empties the allocator's cache before each
                    # recording, which a batch's ~6 recordings would pay for in allocations.
                    graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    try:
                        (body or self._forward)()
                    finally:
                        graph.capture_end()
            finally:
                _clear_cublas_workspaces()
            torch.cuda.current_stream(device).wait_stream(self.stream)
        except RuntimeError as err:
            if distributed.is_out_of_memory(err):
                raise  # decoding's own message: lower decode.max_tokens
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            _REFUSED.append(reason)
            logger.warning(
                "decode.cuda_graphs=on: recording the decoder's step of key %s failed (%s);"
                " decoding goes on without CUDA graphs", self.key, reason,
            )  # fmt: skip
            return None
        self.recorded += 1
        self.recording_s += time.perf_counter() - begin
        return graph


# Why recording failed, once it has in this process: later batches decode eagerly, unwarned.
_REFUSED: list[str] = []


def _clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # CUDA builds
    if clear is not None:
        clear()
