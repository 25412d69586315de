"""``hyperdcp demo``: train on N local CPU ranks, save, resume under another layout and world size.

    hyperdcp demo                       # HSDP (2,2) on 4 ranks -> FSDP2 on 3 ranks
    hyperdcp demo --save-world 2 --load-world 4

Phase 1 spawns ``save_world`` ranks (gloo), shards a small transformer-like model with FSDP2 (HSDP
when the world is a square of 2), trains a few AdamW steps and saves model + optimizer + step with
hyperdcp. Phase 2 spawns ``load_world`` ranks, builds the model under a 1-D FSDP2 layout from a
different seed, loads, checks every tensor bit-exact against phase 1, and trains on.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
import traceback


def _model(dim: int = 64, layers: int = 2, vocab: int = 256):
    import torch

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.out = torch.nn.Linear(dim, dim)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            a = torch.softmax(q @ k.transpose(-1, -2) / dim**0.5, dim=-1)
            return self.out(a @ v)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(dim)
            self.attn = Attention()
            self.norm2 = torch.nn.LayerNorm(dim)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                           torch.nn.Linear(4 * dim, dim))

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.head = torch.nn.Linear(dim, vocab)

        def forward(self, tokens):
            x = self.embed(tokens)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    return TinyLM()


def _setup(seed: int, hsdp: bool):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    torch.manual_seed(seed)
    model = _model()
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (world,)))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _train(model, opt, steps: int, start: int) -> float:
    import torch

    loss = torch.tensor(0.0)
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 256, (8, 16), generator=g)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss.detach())


def _full(model, opt) -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for k, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim.{k}.{name}"] = v.detach().clone() if torch.is_tensor(v) else v
    return out


def _phase_save(rank, world, path, steps, q):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import hyperdcp

    model, opt = _setup(seed=0, hsdp=(world == 4))
    t = time.perf_counter()
    loss = _train(model, opt, steps, 0)
    train_s = time.perf_counter() - t
    msd, osd = get_state_dict(model, opt)
    dist.barrier()
    t = time.perf_counter()
    res = hyperdcp.save({"model": msd, "optim": osd, "step": steps}, path)
    save_s = time.perf_counter() - t
    ref = _full(model, opt)
    host_ref = {k: v.numpy() if hasattr(v, "numpy") else v for k, v in ref.items()} if rank == 0 else None
    q.put(("save", rank, {"loss": loss, "train_s": train_s, "save_s": save_s, "written": res.bytes_written,
                          "ref": host_ref}))


def _phase_load(rank, world, path, steps, ref, q):
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import hyperdcp

    model, opt = _setup(seed=123, hsdp=False)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    dist.barrier()
    t = time.perf_counter()
    res = hyperdcp.load(state, path)
    load_s = time.perf_counter() - t
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = _full(model, opt)
    mismatched = [k for k, v in ref.items() if k not in got or not np.array_equal(
        got[k].numpy() if torch.is_tensor(got[k]) else got[k], v)]
    mismatched += [k for k in got if k not in ref]
    loss = _train(model, opt, 2, state["step"])
    q.put(("load", rank, {"load_s": load_s, "read": res.bytes_read, "mismatched": mismatched,
                          "tensors": len(ref), "step": state["step"], "loss": loss}))


def _worker(fn, rank, world, store, args):
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    q = args[-1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        fn(rank, world, *args)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put(("error", rank, traceback.format_exc()))


def _run(fn, world: int, args: tuple, timeout: float) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = tempfile.mktemp(prefix="hyperdcp-demo-store-")
    procs = [ctx.Process(target=_worker, args=(fn, r, world, store, args + (q,)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out = [None] * world
    deadline = time.monotonic() + timeout
    try:
        for _ in range(world):
            kind, rank, payload = q.get(timeout=max(1.0, deadline - time.monotonic()))
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            out[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if os.path.exists(store):
            os.unlink(store)
    return out


def run(save_world: int = 4, load_world: int = 3, steps: int = 5, directory: str | None = None,
        timeout: float = 300) -> bool:
    import hyperdcp

    root = directory or tempfile.mkdtemp(prefix="hyperdcp-demo-")
    path = os.path.join(root, f"step-{steps}")
    layout = "HSDP mesh (2,2) [Replicate, Shard(0)]" if save_world == 4 else f"FSDP2 on {save_world} ranks"
    print(f"hyperdcp {hyperdcp.__version__} demo: train on {save_world} CPU ranks ({layout}), "
          f"resume on {load_world} ranks (FSDP2 1-D [Shard(0)])")
    t0 = time.perf_counter()
    saved = _run(_phase_save, save_world, (path, steps), timeout)
    meta = hyperdcp.read_metadata(path)
    ref = saved[0]["ref"]
    print(f"  trained {steps} steps (loss {saved[0]['loss']:.4f}) in {max(s['train_s'] for s in saved):.2f}s")
    print(f"  saved {len(meta.tensors)} tensors + {len(meta.values)} value(s) to {path} in "
          f"{max(s['save_s'] for s in saved):.3f}s")
    print(f"    unique tensor bytes {meta.tensor_bytes:,}; on disk {meta.data_file_bytes:,} in {len(meta.files)} files "
          f"(x{meta.data_file_bytes / meta.tensor_bytes:.4f}); written per rank {[s['written'] for s in saved]}")
    loaded = _run(_phase_load, load_world, (path, steps, ref), timeout)
    bad = sorted({k for r in loaded for k in r["mismatched"]})
    print(f"  loaded on {load_world} ranks in {max(r['load_s'] for r in loaded):.3f}s; bytes read per rank "
          f"{[r['read'] for r in loaded]} (sum x{sum(r['read'] for r in loaded) / meta.tensor_bytes:.3f} of unique)")
    if bad:
        print(f"  MISMATCH in {len(bad)} tensor(s): {bad[:10]}")
    else:
        print(f"  all {loaded[0]['tensors']} tensors bit-exact after resharding {save_world} -> {load_world} ranks; "
              f"resumed at step {loaded[0]['step']}, trained 2 more steps (loss {loaded[0]['loss']:.4f})")
    print(f"  total {time.perf_counter() - t0:.1f}s")
    return not bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hyperdcp demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--save-world", type=int, default=4, help="ranks that train and save (default 4)")
    ap.add_argument("--load-world", type=int, default=3, help="ranks that load and resume (default 3)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")


def run_from_args(args) -> int:
    return 0 if run(args.save_world, args.load_world, args.steps, args.dir) else 1


def register(sub) -> None:
    """Add the ``demo`` subcommand to the CLI's subparsers."""
    p = sub.add_parser("demo", help="train on N local CPU ranks, save, resume under another layout")
    add_arguments(p)
    p.set_defaults(func=run_from_args)
