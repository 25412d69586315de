"""torchtitan's own training entry point (``torchtitan.train.main``: its ConfigManager, ``Trainer``, dataloader,
optimizer, LR scheduler, metrics) trains the llama3 debug model on 2 CPU ranks (FSDP2, gloo) with
``HyperdcpCheckpointManager`` chosen in a config registry function; the job is killed -9 in the middle of
step 7, resumes on 1 rank (another world size: model, optimizer, LR scheduler, step and dataloader position
from the 2-rank checkpoint) and gives the uninterrupted 2-rank run's losses, bit for bit.

Everything here is the test's, apart from the integration (hyperdcp_torchtitan.py): the config registry
function (:func:`llama3_debugmodel_hyperdcp`: the user's lines, then the test's CPU settings), tiny assets
written to tmp (torchtitan's tokenizer and c4_test dataset are in its source tree, not in its wheel), and
:func:`cpu_shims` for what torchtitan 0.3.0 on torch 2.13 does not do on CPU (each shim names the place).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import types

import torch.multiprocessing as mp

import hyperdcp

STEPS, INTERVAL, KILLED_IN = 8, 2, 7  # checkpoints at steps 2, 4, 6 (and the last); killed during step 7
SEQ, BATCH, DOCS = 32, 2, 64


def llama3_debugmodel_hyperdcp():
    """A config registry function: ``--module test_torchtitan_resume --config llama3_debugmodel_hyperdcp``."""
    from hyperdcp_torchtitan import use_hyperdcp
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    # the user's lines: torchtitan's debug config (last_save_model_only=False among its checkpoint settings),
    # checkpointed with hyperdcp
    config = use_hyperdcp(llama3_debugmodel())
    config.checkpoint.enable, config.checkpoint.interval, config.checkpoint.keep_latest_k = True, INTERVAL, 2
    # the test's settings: a few short steps on CPU, reproducible
    config.training.steps, config.training.seq_len, config.training.local_batch_size = STEPS, SEQ, BATCH
    config.training.mixed_precision_param = "float32"  # bf16 matmuls are slow on CPU
    config.training.disable_cuda_graphs = True
    # no clipping, so that the runs stay bit-identical across world sizes: the gradients are, but torchtitan's norm
    # of them is a float32 sum of 6M squares taken shard by shard (it differs by ~1e-4), and clipping would scale
    # the update by it
    config.training.max_norm = 1e9
    config.parallelism.spmd_backend = "partial_dtensor"  # spmd_types' FSDP path needs a newer torch (cpu_shims)
    config.activation_checkpoint = None
    config.validator.enable = False
    config.debug.seed = 0
    return config


def write_assets(root: str) -> None:
    """A word-level tokenizer and a c4-like json dataset: two identical halves of DOCS documents each."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(1000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    os.makedirs(os.path.join(root, "tokenizer"))
    tok.save(os.path.join(root, "tokenizer", "tokenizer.json"))
    with open(os.path.join(root, "tokenizer", "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    rnd = random.Random(0)
    docs = [" ".join(f"w{rnd.randrange(1000)}" for _ in range(rnd.randrange(5, 60))) for _ in range(DOCS)]
    os.makedirs(os.path.join(root, "c4"))
    with open(os.path.join(root, "c4", "train.json"), "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs + docs)


def cpu_shims() -> None:
    """Before torchtitan is imported: what torchtitan 0.3.0 needs from CUDA (or a newer torch), done on CPU."""
    import torch
    import torchtitan.tools.utils as tt_utils

    # torchtitan/tools/utils.py:55 picks "cuda" when no accelerator is found, and the Trainer, the memory monitor
    # (components/metrics.py:39) and the device mesh take that device; a device module for the CPU
    tt_utils.device_type = "cpu"
    tt_utils.device_module = types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0, set_device=lambda d: None,
        synchronize=lambda: None, empty_cache=lambda: None, reset_peak_memory_stats=lambda: None,
        memory_stats=lambda d=None: {}, get_device_name=lambda d=None: "cpu",
        get_device_properties=lambda d=None: types.SimpleNamespace(total_memory=1 << 40))

    import torch.nn.functional as F
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    from torchtitan.distributed import fsdp
    from torchtitan.models.common import attention, decoder

    # FlexAttention has no backward on CPU (torch/nn/attention/flex_attention.py, _validate_device): SDPA with the
    # same block-causal mask, made dense; and the mask itself without torch.compile (inductor's CPU build of
    # create_block_mask, models/common/attention.py:622, takes ~15 s)
    def sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        assert score_mod is None and not return_aux.lse
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None

    attention.FlexAttention.compiled_flex_attn = staticmethod(sdpa)
    decoder.create_attention_mask = create_block_mask

    # distributed/fsdp.py:41 sets the gradient divide factor to 1, which FSDP reduces with PREMUL_SUM: not in gloo;
    # a plain sum is the same
    disable_division = fsdp.disable_fsdp_gradient_division

    def sum_reduction(model):
        disable_division(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = sum_reduction
    # distributed/utils.py:595 calls torch.distributed.set_timeout (after step 1), which torch 2.13 has only
    # under its private name
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout

    # torchtitan refuses a dataloader state saved under another dp degree (components/dataloader.py:161, "dataloader
    # resharding is not supported yet"); the test's dataset is two identical halves, so a rank's position in its
    # half under 2 ranks is the same position in the whole under 1 rank: the state is valid under both
    from torchtitan.components.dataloader import ParallelAwareDataloader

    load = ParallelAwareDataloader.load_state_dict
    ParallelAwareDataloader.load_state_dict = lambda self, sd: load(self, {**sd, "world_size": self.dp_world_size}
                                                                    if sd else sd)


def _rank(rank: int, world: int, port: int, root: str, run: str, kill_in: int | None) -> None:
    """One rank of ``torchrun -m torchtitan.train --module ... --config ...`` (the environment torchrun sets)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                      HF_DATASETS_CACHE=os.path.join(run, "hf-datasets"), HF_HUB_OFFLINE="1")
    cpu_shims()
    import torch
    import torchtitan.train
    from torchtitan.components.metrics import MetricsProcessor

    torch.set_num_threads(1)
    # not a CPU matter, only the test's time: rank 0 sleeps 2 s at the end of Trainer.train "for other ranks"
    torchtitan.trainer.time = types.SimpleNamespace(perf_counter=time.perf_counter, sleep=lambda seconds: None)
    losses = []
    log = MetricsProcessor.log

    def record(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)
        losses.append((step, global_avg_loss, grad_norm))
        if step == kill_in and rank == 0:  # the whole job at once, after step 7's update, before its save call
            os.killpg(os.getpgrp(), signal.SIGKILL)

    MetricsProcessor.log = record
    sys.argv = ["torchtitan.train", "--module", "test_torchtitan_resume", "--config", "llama3_debugmodel_hyperdcp",
                "--dump_folder", run, "--hf_assets_path", os.path.join(root, "tokenizer"),
                "--dataloader.dataset_path", os.path.join(root, "c4")]
    torchtitan.train.main()
    with open(os.path.join(run, f"losses-{rank}.json"), "w") as f:
        json.dump(losses, f)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (the runs overlap: one each)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start(world: int, port: int, root: str, run: str, kill_in: int | None = None):
    """``world`` ranks of torchtitan.train, started."""
    return mp.start_processes(_rank, args=(world, port, root, run, kill_in), nprocs=world, start_method="spawn",
                              join=False)


def finish(ctx, run: str) -> dict[int, tuple[float, float]]:
    """The ranks' end; the loss and the gradient norm per step (as rank 0 logged them)."""
    deadline = time.monotonic() + 300
    while not ctx.join(timeout=1):  # a failing rank raises, with its traceback
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError("ranks still running after 300 s")
    with open(os.path.join(run, "losses-0.json")) as f:
        return {step: (loss, norm) for step, loss, norm in json.load(f)}


def test_trainer_killed_resumes_on_another_world_size_and_matches(tmp_path):
    root = str(tmp_path)
    write_assets(root)
    ports = free_ports(3)
    uninterrupted = start(2, ports[0], root, os.path.join(root, "reference"))  # meanwhile, the run that is killed
    run = os.path.join(root, "run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", f"import test_torchtitan_resume as t; t.finish(t.start(2, "
                             f"{ports[1]}, {root!r}, {run!r}, kill_in={KILLED_IN}), {run!r})"], env=env,
                            cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=600,
                            start_new_session=True)
    reference = finish(uninterrupted, os.path.join(root, "reference"))
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpts = os.path.join(run, "checkpoint")
    assert hyperdcp.latest_checkpoint(ckpts).endswith(f"step-{KILLED_IN - 1}")
    assert sorted(os.listdir(ckpts)) == ["step-4", "step-6"]  # keep_latest_k=2: step 2 went once step 6 committed
    for step in os.listdir(ckpts):  # hyperdcp's, not torch DCP's
        assert hyperdcp.is_checkpoint(os.path.join(ckpts, step))
        assert not os.path.exists(os.path.join(ckpts, step, ".metadata"))
    meta = hyperdcp.read_metadata(os.path.join(ckpts, f"step-{KILLED_IN - 1}"))
    assert meta.world_size == 2 and sorted(meta.per_rank_values["dataloader"]) == [0, 1]  # each rank's position
    assert meta.values["train_state"]["step"] == KILLED_IN - 1

    resumed = finish(start(1, ports[2], root, run), run)  # one rank now: the FSDP2 state of 2 ranks, resharded
    assert sorted(resumed) == list(range(KILLED_IN, STEPS + 1))
    for step, (loss, norm) in resumed.items():
        # bit for bit: both ranks read the same batches (the dataset's two halves are equal), so the 2-rank loss
        # (the sum of two equal halves) and FSDP's gradient (the sum of two equal halves) are the 1-rank ones
        assert loss == reference[step][0], (step, loss, reference[step])
        # the same gradients, their norm summed in another order (see max_norm)
        assert abs(norm - reference[step][1]) < 1e-3 * norm, (step, norm, reference[step])
    # the last step's save (torchtitan's _save_last_step) does not purge, as in torchtitan; it is a full one
    # (last_save_model_only=False, kept from torchtitan's debug config by use_hyperdcp)
    assert sorted(os.listdir(ckpts)) == ["step-4", "step-6", f"step-{STEPS}"]
    last = hyperdcp.read_metadata(os.path.join(ckpts, f"step-{STEPS}"))
    assert last.world_size == 1 and any(k.startswith("optimizer.") for k in last.tensors)
