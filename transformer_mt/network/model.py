"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017, §3), top to bottom.

Shapes: B batch, S source length, T target length, D d_model, H heads, K = D // H (d_k = d_v),
V joint vocabulary. Masks are bool, True = may attend.

Sequences are right-padded. The encoder masks padded keys; the decoder's self-attention is causal
(§3.2.3), which for right-padded targets also hides every padded key from every real query, so it
needs no padding mask and can use the fused causal kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.config import ModelConfig

# --- masks and positions -----------------------------------------------------------------------


def make_src_mask(src: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, S) ids -> (B, 1, 1, S): every query may attend to every real source position."""
    return (src != pad_id)[:, None, None, :]


def sinusoidal_positions(n_positions: int, d_model: int) -> torch.Tensor:
    """(n_positions, D): PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(...) (§3.5).

    Computed on the CPU whatever the default device (model.to moves it): a shape-only model on
    the meta device would otherwise pay for torch's meta arange (1.6 s on its first call)."""
    cpu = torch.device("cpu")
    position = torch.arange(n_positions, dtype=torch.float64, device=cpu)[:, None]
    inverse_frequency = torch.pow(
        10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64, device=cpu) / d_model
    )
    table = torch.zeros(n_positions, d_model, dtype=torch.float64, device=cpu)
    table[:, 0::2] = torch.sin(position * inverse_frequency)
    table[:, 1::2] = torch.cos(position * inverse_frequency)
    return table.float()


class Dropout(nn.Module):
    """§5.4 residual dropout: zero each element with probability p, scale the rest by 1/(1-p).

    On CPU the keep-mask is drawn with torch.rand (vectorised), four times faster than the
    element-by-element bernoulli_ behind F.dropout, which took 8 % of a training step; the
    distribution is the same. On CUDA, F.dropout's fused kernel is the fast path.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, training=True)
        keep = torch.rand_like(x) >= self.p
        return x * keep * (1.0 / (1.0 - self.p))


class Embedding(nn.Module):
    """Token embeddings × √d_model plus sinusoidal positions, then dropout (§3.4, §3.5, §5.4).

    One matrix serves the source, the target and (transposed) the pre-softmax projection.
    """

    def __init__(self, vocab_size: int, d_model: int, max_positions: int, dropout: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        # A shape-only model (on the meta device: an import's check of a foreign config) gets a
        # table of no values: computed, a config's d_model of 10^7 took 41 GB before any check.
        positions = (
            torch.empty(max_positions, d_model)
            if self.weight.is_meta
            else sinusoidal_positions(max_positions, d_model)
        )
        self.register_buffer("positions", positions, persistent=False)
        self.scale = math.sqrt(d_model)
        self.dropout = Dropout(dropout)

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """(B, T) ids at positions start.. -> (B, T, D)."""
        x = F.embedding(tokens, self.weight) * self.scale
        return self.dropout(x + self.positions[start : start + tokens.size(1)])


# --- attention ---------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """§3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_h) W^O,
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V), Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V
    (§3.2.1), computed by scaled_dot_product_attention (fused kernels where available).

    W^Q, W^K, W^V are stored stacked in `in_proj` (3D, D), as in nn.MultiheadAttention.
    """

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.attention_dropout = attention_dropout

    def project_self(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, D) -> q, k, v each (B, H, T, K): one fused matmul for self-attention."""
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        return self._heads(q), self._heads(k), self._heads(v)

    def project_query(self, x: torch.Tensor) -> torch.Tensor:
        d = x.size(-1)
        return self._heads(F.linear(x, self.in_proj.weight[:d], self.in_proj.bias[:d]))

    def project_key_value(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output (B, S, D) -> k, v each (B, H, S, K): once per source in decoding."""
        d = memory.size(-1)
        k, v = F.linear(memory, self.in_proj.weight[d:], self.in_proj.bias[d:]).chunk(2, dim=-1)
        return self._heads(k), self._heads(v)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        few_queries: bool = False,
    ) -> torch.Tensor:
        """q (B, H, T, K), k and v (B, H, S, K) -> (B, T, D). mask (B, 1, 1, S): True = attend.

        few_queries (cached decoding, T <= beam): the formula as two matmuls, which at these
        shapes is 2-3x faster than the fused kernel on CPU (scripts/bench_decode.py)."""
        if few_queries:
            scores = (q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)  # (B, H, T, S)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            out = scores.softmax(dim=-1) @ v
        else:
            dropout = self.attention_dropout if self.training else 0.0
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal
            )
        batch, _, length, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))  # (B, T, H·K)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, d = x.shape
        return x.view(batch, length, self.n_heads, d // self.n_heads).transpose(
            1, 2
        )  # (B, H, T, K)


# model.activation: the paper's max(0, ·) (§3.3), or what a converted model was trained with:
# swish x·σ(x) (Marian's default; HF's "swish"/"silu"), gelu with the exact erf (HF's "gelu").
ACTIVATIONS = {"relu": F.relu, "swish": F.silu, "gelu": F.gelu}


class FeedForward(nn.Module):
    """§3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied at each position (max(0, ·) is
    model.activation)."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu") -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.activation(self.linear1(x)))


# --- layers ------------------------------------------------------------------------------------


class Sublayer(nn.Module):
    """§3.1 LayerNorm(x + Dropout(Sublayer(x))) (post-norm, the paper); pre-norm when configured:
    x + Dropout(Sublayer(LayerNorm(x)))."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) if self.pre_norm else x

    def output(self, x: torch.Tensor, sublayer_out: torch.Tensor) -> torch.Tensor:
        y = x + self.dropout(sublayer_out)
        return y if self.pre_norm else self.norm(y)


class EncoderLayer(nn.Module):
    """§3.1: self-attention, then the feed-forward network, each wrapped by a Sublayer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation)
        self.attn_sub = Sublayer(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.ffn_sub = Sublayer(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """(B, S, D) -> (B, S, D)."""
        q, k, v = self.self_attn.project_self(self.attn_sub.input(x))
        x = self.attn_sub.output(x, self.self_attn.attend(q, k, v, mask=src_mask))
        return self.ffn_sub.output(x, self.ffn(self.ffn_sub.input(x)))


@dataclass
class DecoderCache:
    """Incremental decoding state per decoder layer: self-attention K/V of the positions decoded
    so far and cross-attention K/V of the source (computed once).

    The self-attention K/V live in buffers (B·k, H, capacity, K) that grow geometrically: a new
    position is written in place, and reordering the rows (the surviving beams) is one copy of the
    filled positions into a spare buffer, swapped in. In beam search each sentence has `beam`
    consecutive rows (B·k); they share one source, so the cross-attention K/V are kept once per
    sentence (B) and the k beams attend as k queries of it: no copies of the source, and nothing
    to reorder while the set of sentences stays the same.
    """

    beam: int = 1  # consecutive rows per sentence
    length: int = 0  # target positions decoded so far
    self_k: list[torch.Tensor] = field(default_factory=list)  # per layer (B·k, H, capacity, K)
    self_v: list[torch.Tensor] = field(default_factory=list)
    cross_k: list[torch.Tensor] = field(default_factory=list)  # per layer (B, H, S, K)
    cross_v: list[torch.Tensor] = field(default_factory=list)
    spare: torch.Tensor | None = None  # the buffer a reorder writes into
    # Which past positions a step may attend to (1, 1, 1, capacity): None, all of them. A cache
    # of fixed shapes (decoder_graphs.py) holds positions not yet decoded, masked out.
    past_mask: torch.Tensor | None = None

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (N, H, n, K) of `layer` (n new positions, usually 1); the
        layer's past and present keys and values (N, H, t + n, K), views of its buffers."""
        t, end = self.length, self.length + k.size(2)
        if len(self.self_k) <= layer:
            rows, heads, _, dim = k.shape
            for buffers, new in ((self.self_k, k), (self.self_v, v)):
                buffers.append(new.new_empty(rows, heads, max(16, end), dim))
        capacity = self.self_k[layer].size(2)
        if end > capacity:  # full: twice the room, the past copied over
            for buffers in (self.self_k, self.self_v):
                grown = buffers[layer].new_empty(*buffers[layer].shape[:2], max(2 * capacity, end),
                                                 k.size(3))  # fmt: skip
                grown[:, :, :t] = buffers[layer][:, :, :t]
                buffers[layer] = grown
        self.self_k[layer][:, :, t:end] = k
        self.self_v[layer][:, :, t:end] = v
        return self.self_k[layer][:, :, :end], self.self_v[layer][:, :, :end]

    def reorder(
        self, index: torch.Tensor, beam: int, in_order: bool = False
    ) -> torch.Tensor | None:
        """Keep rows `index` (B'·beam,) in this order, e.g. the surviving beams; each group of
        `beam` must come from one sentence (beam search's first step turns each sentence's one
        row into k). Returns the sentences kept (B',), None if all stay as is. `in_order`: the
        caller keeps the sentences in their order (a search: search.SearchState), so as many
        as before are all of them, known without reading the device (a GPU's wait a step)."""
        t = self.length
        for buffers in (self.self_k, self.self_v):
            for i, buffer in enumerate(buffers):
                spare = self.spare
                if spare is None or spare.shape[1:] != buffer.shape[1:] or len(spare) < len(index):
                    self.spare = buffer.new_empty(len(index), *buffer.shape[1:])
                out = self.spare[: len(index)]
                # Search chooses rows; no gradient flows through that choice (and out= has none).
                with torch.no_grad():
                    torch.index_select(buffer[:, :, :t], 0, index, out=out[:, :, :t])
                buffers[i], self.spare = out, buffer
        sentences = index.view(-1, beam)[:, 0] // self.beam  # (B',)
        self.beam = beam
        if len(sentences) == self.cross_k[0].size(0) and (
            in_order or torch.equal(sentences, torch.arange(len(sentences), device=index.device))
        ):
            return None
        # Rows of the sentences kept, each in its layout (Kᵀ contiguous, see start_cache).
        self.cross_k[:] = [k.mT.index_select(0, sentences).mT for k in self.cross_k]
        self.cross_v[:] = [v.index_select(0, sentences) for v in self.cross_v]
        return sentences


class DecoderLayer(nn.Module):
    """§3.1: masked self-attention, attention over the encoder output, feed-forward network."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation)
        self.self_sub = Sublayer(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.cross_sub = Sublayer(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.ffn_sub = Sublayer(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(
        self,
        y: torch.Tensor,
        memory: torch.Tensor | None,
        src_mask: torch.Tensor,
        cache: DecoderCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D). With a cache, y holds the one new position (B, 1, D)."""
        q, k, v = self.self_attn.project_self(self.self_sub.input(y))
        if cache is None:
            attended = self.self_attn.attend(q, k, v, is_causal=True)
            cross_k, cross_v = self.cross_attn.project_key_value(memory)
        else:
            k, v = cache.append(layer, k, v)  # (B, H, t + 1, K): the past plus this step
            # The past: no mask, unless the cache holds positions not yet decoded.
            attended = self.self_attn.attend(q, k, v, mask=cache.past_mask, few_queries=True)
            cross_k, cross_v = cache.cross_k[layer], cache.cross_v[layer]
        y = self.self_sub.output(y, attended)
        q = self.cross_attn.project_query(self.cross_sub.input(y))
        if cache is not None:  # a sentence's k rows are k queries of its one source
            rows, heads, _, dim = q.shape  # (B·k, H, 1, K) -> (B, H, k, K)
            q = q.view(rows // cache.beam, cache.beam, heads, dim).transpose(1, 2)
        crossed = self.cross_attn.attend(  # (B, k or T, D)
            q, cross_k, cross_v, mask=src_mask, few_queries=cache is not None
        )
        y = self.cross_sub.output(y, crossed.reshape(y.shape))
        return self.ffn_sub.output(y, self.ffn(self.ffn_sub.input(y)))


# --- the model ---------------------------------------------------------------------------------


class Transformer(nn.Module):
    """Encoder-decoder Transformer over a joint vocabulary with 3-way tied embeddings (§3.4).

    With model.share_embeddings false the source has its own embedding over its own vocabulary
    (source_vocab_size); the target embedding and the pre-softmax projection stay one matrix."""

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        pad_id: int,
        source_vocab_size: int | None = None,
        source_pad_id: int | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.vocab_size, self.pad_id = cfg, vocab_size, pad_id
        # The source's padding id: the target's, unless separate vocabularies place it elsewhere.
        self.source_pad_id = pad_id if source_pad_id is None else source_pad_id
        self.embedding = Embedding(
            vocab_size, d_model=cfg.d_model, max_positions=cfg.max_positions, dropout=cfg.dropout
        )
        # A module only when not shared, so that a shared model's weights keep their names.
        self.source_embedding = None
        if not cfg.share_embeddings:
            self.source_embedding = Embedding(
                source_vocab_size or vocab_size, cfg.d_model, cfg.max_positions, cfg.dropout
            )
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # Pre-norm leaves each stack's output unnormalised: a final LayerNorm closes it.
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        # model.output_bias: a bias per output token (Marian's, trained with the model).
        self.output_projection = nn.Linear(cfg.d_model, vocab_size, bias=cfg.output_bias)
        # §3.4: "we share the same weight matrix between the two embedding layers and the
        # pre-softmax linear transformation".
        self.output_projection.weight = self.embedding.weight
        self.init_weights()

    def init_weights(self) -> None:
        """Xavier-uniform matrices (as the annotated Transformer), zero biases, unit LayerNorms;
        W^Q, W^K and W^V are initialised as the three separate matrices the paper describes.

        The shared embedding is drawn from N(0, d_model^-0.5), as in tensor2tensor (the paper's
        code) and fairseq: scaled by √d_model, tokens start at unit scale. Xavier-uniform over a
        large vocabulary starts them at ~0.18, under the sinusoids' ~0.55, and with dropout a
        small model then never learned to read its source (measured: docs/benchmarks.md)."""
        if self.embedding.weight.is_meta:  # a shape-only model (checkpoint checks): no values
            return
        for module in self.modules():
            if isinstance(module, MultiHeadAttention):
                for block in module.in_proj.weight.data.chunk(3, dim=0):
                    nn.init.xavier_uniform_(block)
                nn.init.xavier_uniform_(module.out_proj.weight)
            elif isinstance(module, FeedForward):
                nn.init.xavier_uniform_(module.linear1.weight)
                nn.init.xavier_uniform_(module.linear2.weight)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for embedding in (self.embedding, self.source_embedding):  # tied: the projection too
            if embedding is not None:
                nn.init.normal_(embedding.weight, std=self.cfg.d_model**-0.5)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """(B, S) ids -> memory (B, S, D)."""
        embedding = self.embedding if self.source_embedding is None else self.source_embedding
        x = embedding(src)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.encoder_norm(x)

    def decode(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor | None,
        src_mask: torch.Tensor,
        cache: DecoderCache | None = None,
        project: bool = True,
    ) -> torch.Tensor:
        """(B, T) target ids -> logits (B, T, V). With a cache: one new position per call.
        Without `project`: the last layer's normalised states (B, T, D), which a lexical
        shortlist projects onto its own rows of the output matrix (decoding.py)."""
        y = self.embedding(tgt, start=cache.length if cache is not None else 0)
        for i, layer in enumerate(self.decoder_layers):
            y = layer(y, memory, src_mask, cache, i)
        if cache is not None:
            cache.length += tgt.size(1)
        y = self.decoder_norm(y)
        return self.output_projection(y) if project else y

    def start_cache(self, memory: torch.Tensor) -> DecoderCache:
        """A decoding cache holding each layer's cross-attention K/V of `memory` (B, S, D), for
        one decoder row per sentence (beam search makes k of each: DecoderCache.reorder)."""
        cache = DecoderCache()
        for layer in self.decoder_layers:
            k, v = layer.cross_attn.project_key_value(memory)
            # Laid out for the step's matmuls, Kᵀ and V contiguous: not copied again each step.
            cache.cross_k.append(k.transpose(-2, -1).contiguous().transpose(-2, -1))
            cache.cross_v.append(v.contiguous())
        return cache

    def forward(
        self, src: torch.Tensor, tgt_in: torch.Tensor, project: bool = True
    ) -> torch.Tensor:
        """Teacher forcing: (B, S) source, (B, T) bos + target -> logits (B, T, V); without
        `project`, the last states (B, T, D) that a fused loss projects itself."""
        src_mask = make_src_mask(src, self.source_pad_id)
        return self.decode(tgt_in, self.encode(src, src_mask), src_mask, project=project)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def parameter_count(cfg: ModelConfig, vocab_size: int, source_vocab_size: int | None = None) -> int:
    """count_parameters of Transformer(cfg, vocab_size, ..., source_vocab_size) without building
    it: the size a config asks for, known before any memory is allocated (a shared tensor counted
    once)."""
    d, d_ff = cfg.d_model, cfg.d_ff
    attention = 4 * d * d + 4 * d  # W^Q, W^K, W^V (in_proj) and W^O, with biases
    ffn = 2 * d * d_ff + d_ff + d
    norm = 2 * d
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    final_norms = 2 * norm if cfg.pre_norm else 0
    embedding = vocab_size * d  # §3.4: also the decoder's embedding and the output projection
    if not cfg.share_embeddings:
        embedding += (source_vocab_size or vocab_size) * d
    if cfg.output_bias:
        embedding += vocab_size
    return (
        embedding
        + cfg.n_encoder_layers * encoder_layer
        + cfg.n_decoder_layers * decoder_layer
        + final_norms
    )
