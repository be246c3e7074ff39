"""Built-in workloads: small training programs whose allocation traces we record.

Fragmentation depends on the *shape dynamics* of a program more than on its
size: a fixed-shape MLP reuses the same blocks every step, while a language
model whose sequence length changes every step asks for a new mix of sizes
each time. Each workload here is one such pattern, small enough to run a few
steps on a 2-core CPU in seconds, and complete as a training step is on a GPU:
forward, loss, backward, (gradient clipping,) optimizer step.

Everything is generated: token ids with ``torch.randint``, images with
``torch.randn``, initial weights from the seeded default initializers. Nothing
is downloaded. Given a seed a workload is deterministic: the shapes come from
a ``random.Random(seed)`` and the data from a ``torch.Generator`` seeded with
it, and ``torch.manual_seed(seed)`` fixes the initial weights and dropout.

Optimizers use the multi-tensor (``foreach``) implementations that PyTorch
picks by default on CUDA, so a CPU recording allocates optimizer temporaries
the way a GPU run does.

Each workload has a ``tiny`` variant (a few thousand parameters) for tests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence

Batch = tuple[Tensor, ...]


class TrainingRun:
    """A model, its optimizer and its synthetic data stream; :meth:`step` is one training step.

    Subclasses say how a batch is drawn (:meth:`batch`) and how the loss is
    computed (:meth:`loss`); the step itself is the same for all, so every
    workload frees and reallocates gradients and optimizer temporaries in the
    same order a usual training loop does.
    """

    #: What the model is and how its shapes move: goes into a trace's ``source``.
    source: str = ""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, seed: int, device: str,
                 clip_norm: float | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.clip_norm = clip_norm
        self.shapes = random.Random(seed)  # sequence lengths, batch sizes, resolutions
        self.data = torch.Generator(device=self.device)
        self.data.manual_seed(seed)
        self.model.train()

    def batch(self) -> Batch:
        raise NotImplementedError

    def loss(self, batch: Batch) -> Tensor:
        raise NotImplementedError

    def step(self) -> float:
        """One training step; returns the loss (a Python float, so no tensor outlives the step)."""
        # set_to_none frees last step's gradients here, as PyTorch's default does.
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(self.batch())
        loss.backward()
        if self.clip_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm, foreach=True)
        self.optimizer.step()
        return float(loss.detach())

    # helpers for subclasses ------------------------------------------------

    def randint(self, low: int, high: int, shape: tuple[int, ...]) -> Tensor:
        return torch.randint(low, high, shape, generator=self.data, device=self.device)

    def randn(self, shape: tuple[int, ...]) -> Tensor:
        return torch.randn(shape, generator=self.data, device=self.device)

    def rand(self, shape: tuple[int, ...]) -> Tensor:
        return torch.rand(shape, generator=self.data, device=self.device)

    def log_uniform(self, low: int, high: int) -> int:
        """A length in [low, high], skewed to short ones as real text lengths are."""
        return min(high, int(math.exp(self.shapes.uniform(math.log(low), math.log(high + 1)))))


def _adamw(model: nn.Module, lr: float = 3e-4) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=True)


def _init_embeddings(model: nn.Module, std: float = 0.02) -> None:
    """GPT/BERT initialization of embeddings: N(0, 1) ones tied to the output layer give
    logits in the hundreds and a loss no real run sees."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()


# ---- transformer_lm: GPT-like decoder, new sequence length every step -----------


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 8192
    d_model: int = 256
    heads: int = 4
    layers: int = 4
    max_len: int = 256
    min_len: int = 32
    batch: tuple[int, int] = (2, 4)
    dropout: float = 0.1


class _CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, n, d))


class _DecoderBlock(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _GPT(nn.Module):
    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.max_len, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(_DecoderBlock(c.d_model, c.heads, c.dropout) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2 does
        _init_embeddings(self)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TransformerLM(TrainingRun):
    def __init__(self, seed: int, device: str, c: LMConfig) -> None:
        model = _GPT(c).to(device)
        super().__init__(model, _adamw(model), seed, device, clip_norm=1.0)
        self.c = c
        self.source = (f"transformer_lm: GPT-like decoder LM ({c.layers} layers, d={c.d_model}, "
                       f"{c.heads} heads, vocab {c.vocab}, tied embeddings, dropout {c.dropout}); "
                       f"batch {c.batch[0]}-{c.batch[1]} x length {c.min_len}-{c.max_len}, both drawn "
                       f"per step; AdamW (foreach), grad-norm clipping")

    def batch(self) -> Batch:
        b = self.shapes.randint(*self.c.batch)
        n = self.shapes.randint(self.c.min_len, self.c.max_len)
        tokens = self.randint(0, self.c.vocab, (b, n + 1))
        return tokens[:, :-1], tokens[:, 1:]

    def loss(self, batch: Batch) -> Tensor:
        inputs, targets = batch
        logits = self.model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---- encoder_padding: BERT-like encoder, each batch padded to its longest sequence


@dataclass(frozen=True)
class EncoderConfig:
    vocab: int = 8192
    d_model: int = 256
    heads: int = 4
    layers: int = 4
    ffn: int = 1024
    batch: int = 8
    min_len: int = 16
    max_len: int = 256
    mask_prob: float = 0.15
    dropout: float = 0.1


PAD_ID, MASK_ID, FIRST_WORD_ID = 0, 1, 5


class _BertLike(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d_model, padding_idx=PAD_ID)
        self.pos = nn.Embedding(c.max_len, c.d_model)
        self.ln = nn.LayerNorm(c.d_model)
        self.drop = nn.Dropout(c.dropout)
        layer = nn.TransformerEncoderLayer(c.d_model, c.heads, c.ffn, c.dropout, activation="gelu",
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, c.layers, enable_nested_tensor=False)
        self.mlm = nn.Sequential(nn.Linear(c.d_model, c.d_model), nn.GELU(), nn.LayerNorm(c.d_model))
        self.decoder = nn.Linear(c.d_model, c.vocab)
        self.decoder.weight = self.tok.weight
        _init_embeddings(self)

    def forward(self, idx: Tensor, padding: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.ln(self.tok(idx) + self.pos(positions)))
        x = self.encoder(x, src_key_padding_mask=padding)
        return self.decoder(self.mlm(x))


class EncoderPadding(TrainingRun):
    def __init__(self, seed: int, device: str, c: EncoderConfig) -> None:
        model = _BertLike(c).to(device)
        super().__init__(model, _adamw(model), seed, device, clip_norm=1.0)
        self.c = c
        self.source = (f"encoder_padding: BERT-like encoder, masked-LM loss ({c.layers} layers, "
                       f"d={c.d_model}, {c.heads} heads, ffn {c.ffn}, vocab {c.vocab}); batch of "
                       f"{c.batch} sequences with lengths {c.min_len}-{c.max_len} (log-uniform), "
                       f"dynamic padding to the longest of each batch; AdamW (foreach)")

    def batch(self) -> Batch:
        c = self.c
        lengths = [self.log_uniform(c.min_len, c.max_len) for _ in range(c.batch)]
        longest = max(lengths)
        tokens = self.randint(FIRST_WORD_ID, c.vocab, (c.batch, longest))
        length = torch.tensor(lengths, device=self.device)
        padding = torch.arange(longest, device=self.device)[None, :] >= length[:, None]
        tokens.masked_fill_(padding, PAD_ID)
        chosen = (self.rand((c.batch, longest)) < c.mask_prob) & ~padding
        labels = tokens.masked_fill(~chosen, -100)
        return tokens.masked_fill(chosen, MASK_ID), padding, labels

    def loss(self, batch: Batch) -> Tensor:
        inputs, padding, labels = batch
        logits = self.model(inputs, padding)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


# ---- cnn_multiscale: conv / batchnorm / relu / pooling at a new resolution per step


@dataclass(frozen=True)
class CNNConfig:
    widths: tuple[int, ...] = (32, 64, 128, 256)
    classes: int = 100
    batch: int = 16
    resolutions: tuple[int, ...] = (96, 128, 160, 192, 224)


def _conv_bn_relu(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU(inplace=True))


def _cnn(c: CNNConfig) -> nn.Sequential:
    layers: list[nn.Module] = [_conv_bn_relu(3, c.widths[0], stride=2)]
    previous = c.widths[0]
    for i, width in enumerate(c.widths):
        layers += [_conv_bn_relu(previous, width), _conv_bn_relu(width, width)]
        if i + 1 < len(c.widths):
            layers.append(nn.MaxPool2d(2))
        previous = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(previous, c.classes)]
    return nn.Sequential(*layers)


class CNNMultiscale(TrainingRun):
    def __init__(self, seed: int, device: str, c: CNNConfig) -> None:
        model = _cnn(c).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4,
                                    foreach=True)
        super().__init__(model, optimizer, seed, device)
        self.c = c
        self.source = (f"cnn_multiscale: CNN of conv-batchnorm-relu blocks with max pooling, widths "
                       f"{'/'.join(map(str, c.widths))}, {c.classes} classes; batch {c.batch} at a "
                       f"resolution drawn per step from {', '.join(map(str, c.resolutions))} "
                       f"(multi-scale training); SGD with momentum (foreach)")

    def batch(self) -> Batch:
        side = self.shapes.choice(self.c.resolutions)
        return self.randn((self.c.batch, 3, side, side)), self.randint(0, self.c.classes, (self.c.batch,))

    def loss(self, batch: Batch) -> Tensor:
        images, labels = batch
        return F.cross_entropy(self.model(images), labels)


# ---- lstm_varlen: LSTM language model over packed variable-length sequences ------


@dataclass(frozen=True)
class LSTMConfig:
    vocab: int = 8192
    embed: int = 256
    hidden: int = 512
    layers: int = 2
    batch: int = 16
    min_len: int = 8
    max_len: int = 40
    dropout: float = 0.1


class _LSTMLM(nn.Module):
    def __init__(self, c: LSTMConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.embed, padding_idx=PAD_ID)
        self.lstm = nn.LSTM(c.embed, c.hidden, c.layers, batch_first=True,
                            dropout=c.dropout if c.layers > 1 else 0.0)
        self.head = nn.Linear(c.hidden, c.vocab)

    def forward(self, idx: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(self.embed(idx), lengths, batch_first=True, enforce_sorted=False)
        output, _ = self.lstm(packed)
        return self.head(output.data)  # logits of the packed time steps only


class LSTMVarlen(TrainingRun):
    def __init__(self, seed: int, device: str, c: LSTMConfig) -> None:
        model = _LSTMLM(c).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
        super().__init__(model, optimizer, seed, device, clip_norm=0.25)
        self.c = c
        self.source = (f"lstm_varlen: LSTM language model ({c.layers} layers, hidden {c.hidden}, "
                       f"embedding {c.embed}, vocab {c.vocab}); batch {c.batch} sequences of "
                       f"lengths {c.min_len}-{c.max_len} drawn per sequence, pack_padded_sequence; "
                       f"Adam (foreach), grad-norm clipping")

    def batch(self) -> Batch:
        c = self.c
        lengths = [self.shapes.randint(c.min_len, c.max_len) for _ in range(c.batch)]
        tokens = self.randint(FIRST_WORD_ID, c.vocab, (c.batch, max(lengths) + 1))
        # Lengths stay on the CPU: pack_padded_sequence requires it.
        return tokens[:, :-1], tokens[:, 1:], torch.tensor(lengths)

    def loss(self, batch: Batch) -> Tensor:
        inputs, targets, lengths = batch
        logits = self.model(inputs, lengths)
        packed_targets = pack_padded_sequence(targets, lengths, batch_first=True, enforce_sorted=False).data
        return F.cross_entropy(logits, packed_targets)


# ---- seq2seq: encoder-decoder transformer, source and target lengths per step


@dataclass(frozen=True)
class Seq2SeqConfig:
    vocab: int = 8192
    d_model: int = 256
    heads: int = 4
    encoder_layers: int = 3
    decoder_layers: int = 3
    ffn: int = 1024
    batch: tuple[int, int] = (4, 8)
    min_len: int = 16
    max_len: int = 160
    dropout: float = 0.1


class _Seq2Seq(nn.Module):
    def __init__(self, c: Seq2SeqConfig) -> None:
        super().__init__()
        self.src_tok = nn.Embedding(c.vocab, c.d_model)
        self.tgt_tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.max_len, c.d_model)
        self.transformer = nn.Transformer(c.d_model, c.heads, c.encoder_layers, c.decoder_layers, c.ffn,
                                          c.dropout, batch_first=True)
        self.head = nn.Linear(c.d_model, c.vocab)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        src_x = self.src_tok(src) + self.pos(torch.arange(src.shape[1], device=src.device))
        tgt_x = self.tgt_tok(tgt) + self.pos(torch.arange(tgt.shape[1], device=tgt.device))
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        return self.head(self.transformer(src_x, tgt_x, tgt_mask=causal, tgt_is_causal=True))


class Seq2SeqVarlen(TrainingRun):
    def __init__(self, seed: int, device: str, c: Seq2SeqConfig) -> None:
        model = _Seq2Seq(c).to(device)
        super().__init__(model, _adamw(model), seed, device, clip_norm=1.0)
        self.c = c
        self.source = (f"seq2seq: encoder-decoder transformer ({c.encoder_layers}+"
                       f"{c.decoder_layers} layers, d={c.d_model}, {c.heads} heads, ffn {c.ffn}, "
                       f"vocab {c.vocab}); batch {c.batch[0]}-{c.batch[1]}, source and target "
                       f"lengths {c.min_len}-{c.max_len} drawn independently per step "
                       f"(length-bucketed batches); AdamW (foreach)")

    def batch(self) -> Batch:
        c = self.c
        b = self.shapes.randint(*c.batch)
        src_len = self.shapes.randint(c.min_len, c.max_len)
        tgt_len = self.shapes.randint(c.min_len, c.max_len - 1)
        tgt = self.randint(FIRST_WORD_ID, c.vocab, (b, tgt_len + 1))
        return self.randint(FIRST_WORD_ID, c.vocab, (b, src_len)), tgt[:, :-1], tgt[:, 1:]

    def loss(self, batch: Batch) -> Tensor:
        src, tgt_in, tgt_out = batch
        logits = self.model(src, tgt_in)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))


# ---- mlp: the control: every step has the same shapes ------------------------


@dataclass(frozen=True)
class MLPConfig:
    inputs: int = 1024
    hidden: int = 2048
    layers: int = 3
    classes: int = 1000
    batch: int = 256


class MLPFixed(TrainingRun):
    def __init__(self, seed: int, device: str, c: MLPConfig) -> None:
        widths = [c.inputs] + [c.hidden] * c.layers
        layers: list[nn.Module] = []
        for w_in, w_out in zip(widths, widths[1:]):
            layers += [nn.Linear(w_in, w_out), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(widths[-1], c.classes)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
        super().__init__(model, optimizer, seed, device)
        self.c = c
        self.source = (f"mlp: MLP {c.inputs}-{'-'.join([str(c.hidden)] * c.layers)}-{c.classes} "
                       f"with ReLU; fixed shapes, batch {c.batch}; SGD with momentum (foreach)")

    def batch(self) -> Batch:
        return self.randn((self.c.batch, self.c.inputs)), self.randint(0, self.c.classes, (self.c.batch,))

    def loss(self, batch: Batch) -> Tensor:
        x, labels = batch
        return F.cross_entropy(self.model(x), labels)


# ---- registry ------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A built-in workload: its run class, its full-size and test-size configurations.

    ``stem`` names its recorded trace in ``pyalloc/traces/workloads/``: ``mlp`` and
    ``seq2seq`` are recorded as ``mlp_fixed`` and ``seq2seq_varlen`` because
    ``mlp.jsonl.gz`` and ``seq2seq.jsonl.gz`` are the GPU-scale samples.
    """

    name: str
    stem: str
    run: Callable[[int, str, Any], TrainingRun]
    default: Any
    tiny: Any


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("transformer_lm", "transformer_lm", TransformerLM, LMConfig(),
             LMConfig(vocab=64, d_model=16, heads=2, layers=1, max_len=12, min_len=4, batch=(1, 2))),
    Workload("encoder_padding", "encoder_padding", EncoderPadding, EncoderConfig(),
             EncoderConfig(vocab=64, d_model=16, heads=2, layers=1, ffn=32, batch=2, min_len=4, max_len=12)),
    Workload("cnn_multiscale", "cnn_multiscale", CNNMultiscale, CNNConfig(),
             CNNConfig(widths=(4, 8), classes=5, batch=2, resolutions=(8, 12, 16))),
    Workload("lstm_varlen", "lstm_varlen", LSTMVarlen, LSTMConfig(),
             LSTMConfig(vocab=64, embed=8, hidden=16, layers=1, batch=3, min_len=2, max_len=8)),
    Workload("seq2seq", "seq2seq_varlen", Seq2SeqVarlen, Seq2SeqConfig(),
             Seq2SeqConfig(vocab=64, d_model=16, heads=2, encoder_layers=1, decoder_layers=1, ffn=32,
                           batch=(1, 2), min_len=4, max_len=12)),
    Workload("mlp", "mlp_fixed", MLPFixed, MLPConfig(),
             MLPConfig(inputs=16, hidden=32, layers=2, classes=5, batch=4)),
]}


def names() -> list[str]:
    return list(WORKLOADS)


def workload(name: str) -> Workload:
    """A workload by its name or by its trace's stem (``seq2seq_varlen`` is ``seq2seq``)."""
    for w in WORKLOADS.values():
        if name in (w.name, w.stem):
            return w
    raise KeyError(f"unknown workload {name!r} (expected one of {', '.join(WORKLOADS)})")


def build(name: str, seed: int = 0, device: str = "cpu", tiny: bool = False) -> TrainingRun:
    """Builds a workload's model, optimizer and data stream on ``device``.

    Seeds the global RNG (weights, dropout) with ``seed``: a recording must
    be reproducible, and dropout has no generator argument.
    """
    w = workload(name)
    torch.manual_seed(seed)
    return w.run(seed, device, w.tiny if tiny else w.default)
