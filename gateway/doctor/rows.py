"""The doctor's report rows, declared once: each row's name, whether its failure stops the engine's start, and
the order of the report (GPU, then host, then model directory).

A check module returns its rows through `check.passed(rows.X, ...)` and friends, so a row's name and its fatal
flag are written nowhere else. Imports nothing of ours.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One line of the report. `fatal`: a failure here makes the supervisor refuse to spawn the engine."""

    name: str
    fatal: bool = False


GPU_PRESENT = Row("NVIDIA GPU", fatal=True)
DRIVER = Row("driver vs torch CUDA", fatal=True)
FLASH_ATTN = Row("compute capability vs flash-attn")
GPU_MEMORY = Row("GPU memory free", fatal=True)
CUDA_VISIBLE_DEVICES = Row("CUDA_VISIBLE_DEVICES", fatal=True)
PCIE = Row("PCIe link")
DEVICE_NODES = Row("GPU device nodes")
# An engine on several GPUs (multigpu.py).
GPU_COUNT = Row("GPUs for parallelism", fatal=True)
GPU_ACCESS = Row("GPUs usable (cgroup)", fatal=True)
PEER_LINKS = Row("GPU peer links")
NCCL_ENV = Row("NCCL environment")
GPU_PROCESSES = Row("other GPU processes")

CGROUP = Row("cgroup")
OPEN_FILES = Row("open files (ulimit -n)")
DISK = Row("disk for model cache")
PROXY = Row("proxy variables")
REDIS = Row("Redis")
ENGINE_PORT = Row("engine port", fatal=True)

MODEL_DIRECTORY = Row("model directory", fatal=True)
MODEL_CONFIG = Row("model config", fatal=True)
TOKENIZER = Row("tokenizer", fatal=True)
CHAT_TEMPLATE = Row("chat template")
# Served without its parser, a reasoning model's `</think>` leaks into content and streaming clients hang.
REASONING_PARSER = Row("reasoning parser", fatal=True)
BOS = Row("BOS token")
ROPE_THETA = Row("rope_theta")
CONTEXT_LENGTH = Row("context length", fatal=True)

GPU_ROWS = (
    GPU_PRESENT,
    DRIVER,
    FLASH_ATTN,
    GPU_MEMORY,
    CUDA_VISIBLE_DEVICES,
    PCIE,
    DEVICE_NODES,
    GPU_COUNT,
    GPU_ACCESS,
    PEER_LINKS,
    NCCL_ENV,
    GPU_PROCESSES,
)
HOST_ROWS = (CGROUP, OPEN_FILES, DISK, PROXY, REDIS, ENGINE_PORT)
MODEL_ROWS = (
    MODEL_DIRECTORY,
    MODEL_CONFIG,
    TOKENIZER,
    CHAT_TEMPLATE,
    REASONING_PARSER,
    BOS,
    ROPE_THETA,
    CONTEXT_LENGTH,
)
