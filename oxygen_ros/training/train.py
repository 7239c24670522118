"""Train the demo's π0.5 from scratch, the way π0.5 is trained: flow matching on action chunks for the
expert and next-token loss on text (scene questions) for the VLM, in one forward per batch.

    python -m oxygen_ros.training.train --data data/demo --out runs/demo --steps 2500

Seeded (batch k is drawn from seed (seed, k): a resumed run sees the batches it would have seen), prints
progress, saves its state every `--save-every` steps and resumes from it. At the end the weights go to
OUT/model.safetensors (openpi layout, loaded by the engine's strict loader) with OUT/norm_stats.json,
OUT/config.json and OUT/losses.json.

Or fine-tune trained weights: `--init DIR --train expert` trains only the action expert, on `--data` and
any `--extra-data` (e.g. the model's own rollouts, `oxygen_ros.training.data --policy`: DAgger), with
`--prefix-delay-max 10` with prefix conditioning (training-time real-time chunking); the shipped demo_rtc
is made so (docs/demo_model.md).

`--joint`: the hierarchical demo model (docs/demo_model.md): multi-step data (`data --multistep`) in pi052's
joint format (training/batches.py: make_joint_batch), the subtask, the progress memory and the scene answers
as text, the actions read the prompt and the subtask span.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from safetensors.torch import load_file, save_file

from oxygen_ros.model.checkpoint import load_pi05, save_checkpoint
from oxygen_ros.model.config import Pi05Config, preset
from oxygen_ros.model.normalize import Normalizer
from oxygen_ros.model.pi05 import Pi05
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.sim.scene import COLOUR_NAMES

from . import data as datagen
from .attention import TrainActionAttention
from .batches import Batch, make_batch, make_joint_batch, norm_stats

PATCH_CLASSES = 1 + 2 * len(COLOUR_NAMES)       # none, each colour, each colour touched (batches.patch_colours)


def init_weights(model: Pi05, seed: int) -> Pi05:
    """Training init: PyTorch defaults for the linears; embeddings ~ N(0, 1/width) (they are scaled by
    sqrt(width)); position embeddings ~ N(0, 0.1); adaRMS modulations at zero (each expert block starts as the
    identity, as DiT's adaLN-zero)."""
    torch.manual_seed(seed)
    model = Pi05(model.cfg)
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0.0, model.cfg.vlm.width ** -0.5)
        model.vision.position_embedding.normal_(0.0, 0.1)
        for name, p in model.named_parameters():
            if ".dense." in name or name.startswith("expert_norm.dense"):
                p.zero_()
    return model


def flow_matching_loss(model: Pi05, batch: Batch, gen: torch.Generator) -> torch.Tensor:
    """openpi's π0.5 loss: x_t = t * noise + (1 - t) * actions, the expert predicts noise - actions;
    t ~ Beta(1.5, 1) * 0.999 + 0.001 (more weight on noisy times).

    With `batch.given_rows` (prefix conditioning, training-time RTC, Black et al. 2025): each sample's first
    given_rows rows are given clean at flow time 0 (as the engine gives the rows the robot plays while a
    chunk computes: Pi05._sample_conditioned), and the loss is on the other rows only."""
    a = batch.actions
    b, h = a.shape[:2]
    noise = torch.randn(a.shape, generator=gen)
    # Beta(1.5, 1) has CDF t^1.5: drawn by inversion from the batch's generator (resumable runs).
    t = torch.rand(b, generator=gen) ** (1 / 1.5) * 0.999 + 0.001
    attn = TrainActionAttention(batch.attention, h)
    if batch.given_rows is None:
        x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * a
        return F.mse_loss(model.denoise_step(x_t, t, attn), noise - a)
    given = torch.arange(h)[None, :] < batch.given_rows[:, None]               # [B, H]
    t_rows = torch.where(given, 0.0, t[:, None].expand(b, h))                  # given rows: x_t = actions
    x_t = t_rows[..., None] * noise + (1 - t_rows[..., None]) * a
    error = (model.denoise_step(x_t, t_rows, attn) - (noise - a)) ** 2
    free = (~given)[..., None].float()
    return (error * free).sum() / (free.sum() * a.shape[-1])


# What a joint-format checkpoint's config.json names as its recipe: LeRobot pi052's subtask + memory recipe, the
# one whose memory turns the progress memory follows (Pi052Format.from_config reads memory from the name).
JOINT_RECIPE = "recipes/subtask_mem.yaml"

# The action expert's parameters: what --train expert fine-tunes (the VLM, SigLIP and their K/V stay as they are).
EXPERT_PARAMETERS = ("expert_layers.", "expert_norm.", "action_in_proj.", "action_out_proj.", "time_mlp_in.",
                     "time_mlp_out.")


class PatchColourProbe(nn.Module):
    """Training aid, not part of the model: a linear read-out of each image token (SigLIP's output) that must
    say which cube colour its patch shows. From scratch, a small VLM's text and actions first learn the
    answers' and motions' priors and ignore the image (measured: 700 steps with the image making no
    difference to either loss); this dense, easy signal makes the image tokens informative from the start
    (π0.5 co-trains on localisation data for the same reason). Dropped after training."""

    def __init__(self, width: int, classes: int):
        super().__init__()
        self.out = nn.Linear(width, classes)


def losses(model: Pi05, batch: Batch, gen: torch.Generator, probe: PatchColourProbe | None = None,
           expert_only: bool = False):
    """(flow matching, answer tokens, patch colours) losses of one batch. `expert_only`: the VLM is frozen,
    its forward only gives the prefix K/V (no gradient) and the other two losses are zero."""
    if expert_only:
        with torch.no_grad():
            model.prefill(batch.rows, batch.attention)
        zero = torch.zeros(())
        return flow_matching_loss(model, batch, gen), zero, zero
    features = {}
    if probe is not None:
        hook = model.vision.register_forward_hook(lambda _m, _i, out: features.setdefault("v", out))
    try:
        hidden = model.prefill(batch.rows, batch.attention)    # the answer positions' final hidden states
    finally:
        if probe is not None:
            hook.remove()
    text = F.cross_entropy(model.logits(hidden), batch.answer_targets)
    colours = (F.cross_entropy(probe.out(features["v"]).flatten(0, 1), batch.patch_colours.flatten())
               if probe is not None else torch.zeros(()))
    return flow_matching_loss(model, batch, gen), text, colours


def learning_rate(step: int, steps: int, peak: float, warmup: int = 100,
                  restart: tuple[int, float] | None = None) -> float:
    """Warmup then cosine to a tenth of `peak` at `steps`. With `restart` (at, peak2): unchanged before `at` (the
    steps a resumed run already trained), then a fresh cosine from `peak2` to a tenth of it at `steps` (a resumed
    run extended with a lower final learning rate, instead of the first cosine stretched to the new `steps`,
    which would jump back up)."""
    if restart is not None and step >= restart[0]:
        at, peak2 = restart
        return peak2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - at) / max(1, steps - at))))
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


class Trainer:
    """From scratch, or (`init`: a checkpoint directory) fine-tuning a trained model with its own norm stats;
    `expert_only`: only EXPERT_PARAMETERS train (flow matching alone), so the VLM's K/V, answers and
    captions stay bit for bit those of `init`. `prefix_delay_max`: prefix conditioning (flow_matching_loss)."""

    def __init__(self, cfg: Pi05Config, data: dict[str, np.ndarray], out: Path, batch_size: int, steps: int,
                 lr: float, seed: int, log=print, restart: tuple[int, float] | None = None,
                 init: Path | None = None, expert_only: bool = False, prefix_delay_max: int = 0,
                 joint: bool = False):
        if expert_only and init is None:
            raise ValueError("training the expert alone needs a trained model to start from (init)")
        if joint and (expert_only or prefix_delay_max):
            raise ValueError("the joint format trains the whole model without prefix conditioning")
        if prefix_delay_max < 0 or prefix_delay_max >= cfg.action_horizon:
            raise ValueError(f"prefix_delay_max must be in 0..{cfg.action_horizon - 1}, got {prefix_delay_max}")
        self.cfg = cfg.replace(prefix_conditioning=bool(prefix_delay_max) or cfg.prefix_conditioning)
        self.data, self.out, self.log = data, Path(out), log
        self.restart, self.expert_only, self.prefix_delay_max = restart, expert_only, prefix_delay_max
        self.joint = joint
        self.batch_size, self.steps, self.lr, self.seed = batch_size, steps, lr, seed
        self.out.mkdir(parents=True, exist_ok=True)
        stats = (json.loads((Path(init) / "norm_stats.json").read_text()) if init is not None
                 else norm_stats(data))
        (self.out / "norm_stats.json").write_text(json.dumps(stats, indent=1))
        self.norm = Normalizer.load(self.out / "norm_stats.json")
        self.tok = Tokenizer.tiny()
        if init is None:
            self.model = init_weights(Pi05(self.cfg), seed).train()
        else:       # the loader gives a serving model (no gradients): every parameter trains unless expert_only
            self.model = load_pi05(Path(init), self.cfg).train().requires_grad_(True)
        self.probe = None if expert_only else PatchColourProbe(cfg.vision.width, PATCH_CLASSES)
        if expert_only:
            for name, p in self.model.named_parameters():
                p.requires_grad_(name.startswith(EXPERT_PARAMETERS))
        params = [p for p in self.model.parameters() if p.requires_grad]
        params += list(self.probe.parameters()) if self.probe is not None else []
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
        self.step, self.history, self.elapsed = 0, [], 0.0
        self._resume()

    # ------------------------------------------------------------------ state
    @property
    def state_dir(self) -> Path:
        return self.out / "train_state"

    def _resume(self) -> None:
        meta = self.state_dir / "meta.json"
        if not meta.is_file():
            return
        m = json.loads(meta.read_text())
        self.model.load_state_dict(load_file(str(self.state_dir / "model.safetensors")))
        if self.probe is not None:
            self.probe.load_state_dict(load_file(str(self.state_dir / "probe.safetensors")))
        self.opt.load_state_dict(torch.load(self.state_dir / "optimizer.pt", weights_only=True))
        self.step, self.history, self.elapsed = m["step"], m["history"], m["elapsed_s"]
        self.log(f"[train] resumed at step {self.step}")

    def save_state(self) -> None:
        self.state_dir.mkdir(exist_ok=True)
        for name, module in (("model", self.model), ("probe", self.probe)):
            if module is None:
                continue
            save_file({k: v.contiguous() for k, v in module.state_dict().items()},
                      str(self.state_dir / f"{name}.safetensors"))
        torch.save(self.opt.state_dict(), self.state_dir / "optimizer.pt")
        (self.state_dir / "meta.json").write_text(json.dumps(
            {"step": self.step, "history": self.history, "elapsed_s": self.elapsed}))

    # ------------------------------------------------------------------ loop
    def batch(self, step: int) -> tuple[Batch, torch.Generator]:
        rng = np.random.default_rng([self.seed, step])
        index = rng.choice(len(self.data["image"]), size=self.batch_size, replace=False)
        if self.joint:
            b = make_joint_batch(self.data, index, self.tok, self.norm, rng, self.cfg.vision.image_size,
                                 self.cfg.image_tokens, self.cfg.max_token_len)
        else:
            b = make_batch(self.data, index, self.tok, self.norm, rng, self.cfg.vision.image_size,
                           self.cfg.image_tokens, self.cfg.max_token_len, self.prefix_delay_max)
        return b, torch.Generator().manual_seed(self.seed * 1_000_003 + step)

    def train_step(self) -> tuple[float, float, float]:
        batch, gen = self.batch(self.step)
        for g in self.opt.param_groups:
            g["lr"] = learning_rate(self.step, self.steps, self.lr, restart=self.restart)
        flow, text, colours = losses(self.model, batch, gen, self.probe, self.expert_only)
        self.opt.zero_grad(set_to_none=True)
        (flow + text + colours).backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], 1.0)
        self.opt.step()
        self.step += 1
        return flow.item(), text.item(), colours.item()

    def run(self, log_every: int = 20, save_every: int = 200, until: int | None = None) -> list:
        """Train to `steps` (or stop early at `until`, keeping the schedule of `steps`), saving the state."""
        window = []
        while self.step < min(self.steps, until or self.steps):
            t0 = time.monotonic()
            window.append(self.train_step())
            self.elapsed += time.monotonic() - t0
            if self.step % log_every == 0 or self.step == self.steps:
                flow, text, colours = np.mean(window, axis=0)
                window = []
                self.history.append({"step": self.step, "flow": float(flow), "text": float(text),
                                     "patch_colours": float(colours), "elapsed_s": round(self.elapsed, 1)})
                per = self.elapsed / self.step
                self.log(f"[train] step {self.step}/{self.steps} flow {flow:.4f} text {text:.4f} "
                         f"patch colours {colours:.4f} "
                         f"{per:.2f} s/step, {self.elapsed / 60:.1f} min, ETA {(self.steps - self.step) * per / 60:.1f} min")
            if self.step % save_every == 0:
                self.save_state()
        self.save_state()
        return self.history

    def export(self) -> Path:
        """The trained weights as a checkpoint the engine loads (openpi names, safetensors)."""
        path = save_checkpoint(self.model.eval(), self.out)
        config = {"action_horizon": self.cfg.action_horizon, "action_dim": self.cfg.action_dim}
        if self.cfg.prefix_conditioning:
            config["prefix_conditioning"] = True
        if self.joint:      # pi052's joint recipe with progress memory (model/pi052.py: Pi052Format.from_config)
            config.update(joint_subtask_conditioning=True, recipe_path=JOINT_RECIPE)
        (self.out / "config.json").write_text(json.dumps(config))
        (self.out / "losses.json").write_text(json.dumps(self.history, indent=0))
        return path


def plot_losses(history: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps, [h["flow"] for h in history], label="flow matching (actions)")
    ax.plot(steps, [h["text"] for h in history], label="next token (answers)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train the demo π0.5 (resumable).")
    p.add_argument("--data", type=Path, default=Path("data/demo"))
    p.add_argument("--samples", type=int, default=16000, help="rendered first if the cache lacks them")
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--until", type=int, default=None,
                   help="stop at this step (the schedule stays that of --steps) and export; with a saved state at "
                        "or past it, only export")
    p.add_argument("--restart-at", type=int, default=None,
                   help="from this step on (a resumed run), a fresh cosine from --restart-lr to a tenth of it at "
                        "--steps, instead of the first cosine stretched to the new --steps")
    p.add_argument("--restart-lr", type=float, default=None)
    p.add_argument("--init", type=Path, default=None,
                   help="fine-tune this checkpoint directory (model.safetensors, norm_stats.json) instead of "
                        "training from scratch")
    p.add_argument("--train", choices=("all", "expert"), default="all",
                   help="expert: only the action expert trains (flow matching; needs --init): the VLM's answers "
                        "and captions stay those of --init")
    p.add_argument("--extra-data", type=Path, nargs="+", default=[],
                   help="directories of shards trained on with --data's (e.g. a checkpoint's own rollouts: "
                        "oxygen_ros.training.data --policy)")
    p.add_argument("--joint", action="store_true",
                   help="the hierarchical demo model: multi-step data (rendered with data --multistep if missing) in "
                        "pi052's joint format: subtask, progress memory and scene answers as text forks of the frame's "
                        "prompt, the actions reading the subtask span")
    p.add_argument("--prefix-delay-max", type=int, default=0,
                   help="prefix conditioning (training-time RTC): each sample's first 0..N rows given clean, "
                        "the loss on the others; the checkpoint then serves rtc_correction prefix")
    a = p.parse_args(argv)
    if (a.restart_at is None) != (a.restart_lr is None):
        p.error("--restart-at and --restart-lr go together")
    if a.train == "expert" and a.init is None:
        p.error("--train expert needs --init (a trained model to start from)")
    horizon = preset("demo").action_horizon
    if not 0 <= a.prefix_delay_max < horizon:
        p.error(f"--prefix-delay-max {a.prefix_delay_max} must be in 0..{horizon - 1} (rows of a {horizon}-row chunk)")
    missing = [f for f in ("model.safetensors", "norm_stats.json") if a.init is not None and not (a.init / f).is_file()]
    if missing:
        p.error(f"--init {a.init}: no {' or '.join(missing)} there")
    extra = {d: sorted(d.glob("shard_*.npz")) for d in a.extra_data}
    empty = [str(d) for d, shards in extra.items() if not shards]
    if empty:
        p.error(f"--extra-data {' '.join(empty)}: no shard_*.npz there")
    torch.set_num_threads(a.threads)
    cfg = preset("demo")
    if a.joint and (a.train == "expert" or a.prefix_delay_max or a.extra_data):
        p.error("--joint trains the whole model on multi-step data alone (no --train expert, --prefix-delay-max, "
                "--extra-data)")
    paths = datagen.generate(a.data, a.samples, a.seed, cfg.vision.image_size, cfg.action_horizon,
                             multistep=a.joint)
    restart = None if a.restart_at is None else (a.restart_at, a.restart_lr)
    paths += [shard for shards in extra.values() for shard in shards]
    trainer = Trainer(cfg, datagen.load(paths), a.out, a.batch, a.steps, a.lr, a.seed, restart=restart,
                      init=a.init, expert_only=a.train == "expert", prefix_delay_max=a.prefix_delay_max,
                      joint=a.joint)
    plot_losses(trainer.run(until=a.until), a.out / "losses.png")
    print(trainer.export())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
