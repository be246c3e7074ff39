"""GPU-scale models for `pyalloc record --meta`: LLaMA-style decoders, ViT-L/16, ResNet-50.

Each is built and trained on PyTorch's meta device (shapes only, no memory),
so a 7B-parameter model records in seconds on a laptop. Parameters,
gradients and optimizer state are bf16 throughout (pure bf16 training, as
in many LLaMA fine-tuning setups; no fp32 master weights). The decoder's
attention calls the flash-attention operator that PyTorch picks for bf16 on
an H100 (``aten._scaled_dot_product_flash_attention``): on meta,
``scaled_dot_product_attention`` would take the math path and materialize
the full attention matrix, which a GPU run does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

Step = Callable[[], object]


@dataclass(frozen=True)
class MetaModel:
    name: str
    description: str
    build: Callable[["MetaConfig"], Step]
    default_batch: int
    default_seq: int  # tokens (decoders); image side (vision models)


@dataclass(frozen=True)
class MetaConfig:
    batch: int
    seq: int
    checkpoint: bool
    seed: int = 0


def _training_step(forward: Callable[[], torch.Tensor], opt: torch.optim.Optimizer) -> Step:
    """One step: the loss, its backward, the optimizer, gradients dropped (set_to_none)."""
    def step() -> object:
        loss = forward()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


# ---- LLaMA-style decoder -------------------------------------------------------------


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    layers: int
    heads: int
    mlp: int
    vocab: int = 32000


DECODERS = {
    # TinyLlama-1.1B's shape (22 layers, hidden 2048, MLP 5632), with full multi-head attention.
    "llama1b": DecoderShape(hidden=2048, layers=22, heads=32, mlp=5632),
    # LLaMA-2-7B: hidden 4096, 32 layers, 32 heads, MLP 11008, vocabulary 32000.
    "llama7b": DecoderShape(hidden=4096, layers=32, heads=32, mlp=11008),
    # For tests: the same code at a size that records in a fraction of a second.
    "llama-tiny": DecoderShape(hidden=256, layers=2, heads=4, mlp=688, vocab=1024),
}


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DecoderLayer(nn.Module):
    def __init__(self, s: DecoderShape) -> None:
        super().__init__()
        self.heads = s.heads
        self.attn_norm = nn.RMSNorm(s.hidden)
        self.q = nn.Linear(s.hidden, s.hidden, bias=False)
        self.k = nn.Linear(s.hidden, s.hidden, bias=False)
        self.v = nn.Linear(s.hidden, s.hidden, bias=False)
        self.o = nn.Linear(s.hidden, s.hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(s.hidden)
        self.gate = nn.Linear(s.hidden, s.mlp, bias=False)
        self.up = nn.Linear(s.hidden, s.mlp, bias=False)
        self.down = nn.Linear(s.mlp, s.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        # What PyTorch runs for bf16 on an H100: flash attention (the module docstring).
        a = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, s: DecoderShape, use_checkpoint: bool) -> None:
        super().__init__()
        self.shape = s
        self.use_checkpoint = use_checkpoint
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        head_dim = self.shape.hidden // self.shape.heads
        freqs = torch.arange(t, device=ids.device).float()[:, None] / (
            10000 ** (torch.arange(0, head_dim, 2, device=ids.device).float() / head_dim))
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        x = self.embed(ids)
        for layer in self.layers:
            if self.use_checkpoint:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, self.shape.vocab), ids.view(-1))


def _decoder(shape: DecoderShape) -> Callable[[MetaConfig], Step]:
    def build(cfg: MetaConfig) -> Step:
        model = Decoder(shape, cfg.checkpoint).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        return _training_step(lambda: model(torch.randint(0, shape.vocab, (cfg.batch, cfg.seq))), opt)
    return build


# ---- ViT-L/16 ------------------------------------------------------------------------


class VitBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp)
        self.fc2 = nn.Linear(mlp, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False)[0]
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class VitL16(nn.Module):
    """ViT-L/16: patch 16, hidden 1024, 24 layers, 16 heads, MLP 4096, 1000 classes."""

    def __init__(self, image: int, use_checkpoint: bool, layers: int = 24, hidden: int = 1024) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.patch = nn.Conv2d(3, hidden, kernel_size=16, stride=16)
        tokens = (image // 16) ** 2 + 1
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos = nn.Parameter(torch.zeros(1, tokens, hidden))
        self.blocks = nn.ModuleList(VitBlock(hidden, hidden // 64, 4 * hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, 1000)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1) + self.pos
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.use_checkpoint else block(x)
        return F.cross_entropy(self.head(self.norm(x[:, 0])).float(), labels)


# ---- ResNet-50 -----------------------------------------------------------------------


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (self.down(x) if self.down is not None else x))


class ResNet50(nn.Module):
    """torchvision's ResNet-50 layout: bottlenecks [3, 4, 6, 3], widths 64 to 512, 1000 classes."""

    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        stages, cin = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            layers = []
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = 4 * width
            stages.append(nn.Sequential(*layers))
        self.stages = nn.ModuleList(stages)
        self.fc = nn.Linear(cin, 1000)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for stage in self.stages:
            x = checkpoint(stage, x, use_reentrant=False) if self.use_checkpoint else stage(x)
        return F.cross_entropy(self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)).float(), labels)


def _vision(make: Callable[[MetaConfig], nn.Module], optimizer: str) -> Callable[[MetaConfig], Step]:
    def build(cfg: MetaConfig) -> Step:
        model = make(cfg).to(torch.bfloat16)
        opt: torch.optim.Optimizer
        if optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)

        def forward() -> torch.Tensor:
            images = torch.empty(cfg.batch, 3, cfg.seq, cfg.seq, dtype=torch.bfloat16)
            loss: torch.Tensor = model(images, torch.randint(0, 1000, (cfg.batch,)))
            return loss

        return _training_step(forward, opt)
    return build


MODELS: dict[str, MetaModel] = {
    "llama1b": MetaModel("llama1b", "LLaMA-style decoder, 1.1B parameters (hidden 2048, 22 layers, 32 heads, "
                         "MLP 5632, vocabulary 32000; RMSNorm, rotary, SwiGLU, causal flash attention)",
                         _decoder(DECODERS["llama1b"]), default_batch=8, default_seq=4096),
    "llama7b": MetaModel("llama7b", "LLaMA-2-7B-shaped decoder, 6.7B parameters (hidden 4096, 32 layers, 32 heads, "
                         "MLP 11008, vocabulary 32000; RMSNorm, rotary, SwiGLU, causal flash attention)",
                         _decoder(DECODERS["llama7b"]), default_batch=1, default_seq=2048),
    "llama-tiny": MetaModel("llama-tiny", "LLaMA-style decoder for tests (hidden 256, 2 layers, 4 heads)",
                            _decoder(DECODERS["llama-tiny"]), default_batch=2, default_seq=128),
    "vit_l": MetaModel("vit_l", "ViT-L/16 (hidden 1024, 24 layers, 16 heads, MLP 4096, 224x224 images, "
                       "1000 classes; flash attention), AdamW", _vision(lambda c: VitL16(c.seq, c.checkpoint), "adamw"),
                       default_batch=256, default_seq=224),
    "resnet50": MetaModel("resnet50", "ResNet-50 (bottlenecks 3-4-6-3, 224x224 images, 1000 classes), SGD with "
                          "momentum", _vision(lambda c: ResNet50(c.checkpoint), "sgd"),
                          default_batch=256, default_seq=224),
}


def parameters_of(name: str) -> int:
    """The parameter count of a decoder shape (for descriptions and tests)."""
    s = DECODERS[name]
    per_layer = 4 * s.hidden * s.hidden + 3 * s.hidden * s.mlp + 2 * s.hidden
    return s.layers * per_layer + 2 * s.vocab * s.hidden + s.hidden


def human(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"

