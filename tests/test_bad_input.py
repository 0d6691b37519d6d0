"""A catalogue of bad input, each case run as a user would: one line `error: …` naming the setting
or the fix, exit code 2, no traceback, and nothing made on disk."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from kit import REPO, kit, kit_here, one_error_line, run_folder, wait_for
from paced import LASTING

from slurm_ddp_kit.core import runfolder
from slurm_ddp_kit.core.settings.loading import load_config
from slurm_ddp_kit.train.data import _write_idx, synthetic_digits

NO_CUDA = not torch.cuda.is_available()
EVERY_COMMAND = (("submit",), ("submit", "--dry-run"), ("config",))
SUBMIT_ONLY = (("submit",), ("submit", "--dry-run"))  # `config` checks neither hardware nor disk
# What a new run is asked, by `launch submit` and by the sbatch scripts' `launch prepare`.
NEW_RUN = (*SUBMIT_ONLY, ("prepare",))


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]  # after the defaults below; "{tmp}" is the test's folder
    fragments: tuple[str, ...]  # each must appear in the error line
    commands: tuple[tuple[str, ...], ...] = EVERY_COMMAND
    mode: tuple[str, ...] = ("--mode", "ddp")
    skip: str = ""  # a reason to skip the case here


QUOTE_FIX = "needs quotes inside the argument"
NAME_FIX = ("may hold only letters, digits", "e.g. output.name=lr-0.1")
UNWRITABLE = ("not writable by this user", "pick a folder you can write")
SHELL_CHAR = (
    "holds a character that Slurm's log patterns or the shell would rewrite",
    "a space, %",
)

LONG = "n" * 256  # one byte more than a file name may have

CASES = [
    Case("lr=-1", ("train.lr=-1",), ("train.lr=-1.0 must be a positive number", "train.lr=0.01")),
    Case("lr=0", ("train.lr=0",), ("train.lr=0.0 must be a positive number", "train.lr=0.01")),
    Case("momentum=-5", ("train.momentum=-5",), ("train.momentum=-5.0 must be in [0, 1)", "0.9")),
    Case("momentum=1", ("train.momentum=1",), ("train.momentum=1.0 must be in [0, 1)", "0.9")),
    Case(
        "target=0",
        ("train.target_accuracy=0",),
        ("train.target_accuracy=0.0 must be in (0, 1]", "0.985"),
    ),
    Case(
        "target=98.5",
        ("train.target_accuracy=98.5",),
        ("train.target_accuracy=98.5 must be in (0, 1]", "a share"),
    ),
    Case(
        "target=nan",
        ("train.target_accuracy=nan",),
        ("train.target_accuracy=nan must be in (0, 1]",),
    ),
    Case("workers=-1", ("data.num_workers=-1",), ("data.num_workers=-1 must be between 0 and 64",)),
    Case("seed=-1", ("train.seed=-1",), ("train.seed=-1 must be between 0 and 4294967295",)),
    Case("port=99999", ("dist.port=99999",), ("dist.port=99999", "pick one in 1024–65535, or 0")),
    Case("port=80", ("dist.port=80",), ("dist.port=80", "pick one in 1024–65535, or 0")),
    Case("timeout_s=0", ("dist.timeout_s=0",), ("dist.timeout_s=0 must be between 1 and",)),
    Case("mem_gb=-4", ("cluster.mem_gb=-4",), ("cluster.mem_gb=-4 must be between 0 and",)),
    Case("progress_s=-1", ("output.progress_s=-1",), ("output.progress_s=-1 must be between 0",)),
    Case(
        "signal_delay=-1",
        ("cluster.signal_delay_s=-1",),
        ("cluster.signal_delay_s=-1 must be between 0 and 65535",),
    ),
    Case("name=a/b", ("output.name=a/b",), ("output.name='a/b'", *NAME_FIX)),
    Case("name=50%", ("output.name=50%",), ("output.name='50%'", *NAME_FIX)),
    Case(
        "name=.hidden",
        ("output.name=.hidden",),
        ("output.name='.hidden'", "starting with a letter or digit", *NAME_FIX),
    ),
    *[
        Case(f"name={value}", (f"output.name={value}",), (f"output.name={value}", QUOTE_FIX))
        for value in ("`x", "@x", "%x", "*x", "!x", "[a")
    ],
    Case(
        "sbatch_extra=list",
        ("cluster.sbatch_extra=[1,2]",),
        ("cluster.sbatch_extra=[1, 2] must be a mapping", "{mail-type: END}"),
    ),
    Case("setup=3", ("cluster.setup=3",), ("cluster.setup=3 must be a list",)),
    Case(
        "mnist missing",
        ("data.dataset=mnist",),
        ("train-images-idx3-ubyte is missing", "python -m train fetch-mnist --root"),
        NEW_RUN,
    ),
    Case(
        "data.root in a file",
        ("data.root={tmp}/file/x",),
        ("/file is a file; point data.root at a folder", "data.root=data"),
        NEW_RUN,
    ),
    *[
        Case(
            f"{key} of no user",
            (f"{key}=~nosuchuser/x",),
            (f"{key}=~nosuchuser/x: ~nosuchuser names no user", "write the path in full"),
            SUBMIT_ONLY,
        )
        for key in ("data.root", "output.root")
    ],
    Case(
        "setup=[[1]]",
        ("cluster.setup=[[1]]",),
        ("cluster.setup holds [1]", "each one string", "module load cuda"),
    ),
    Case(
        "sbatch_extra nested",
        ("cluster.sbatch_extra={mail-type: {b: c}}",),
        ("cluster.sbatch_extra has mail-type={'b': 'c'}", "values one non-empty line"),
    ),
    Case(
        "sbatch_extra owned",
        ("cluster.sbatch_extra={ntasks-per-node: 2}",),
        ("sbatch_extra sets ntasks-per-node, which the kit writes itself", "cluster.gpus_per_node"),
    ),
    Case(
        "sbatch_extra time",
        ("cluster.sbatch_extra.time=10",),
        ("sbatch_extra sets time", "cluster.timeout_min"),
    ),
    *[
        Case(
            f"{key} sbatch_extra",
            (f"cluster.sbatch_extra.{key}=4",),
            (f"sbatch_extra sets {key}, which the kit writes itself", fix),
        )
        for key, fix in (
            ("gpus", "cluster.gpus_per_node"),
            ("n", "cluster.gpus_per_node"),
            ("array", "launch sweep"),
            ("wrap", "batch script"),
            ("no-requeue", "cluster.max_requeues"),
        )
    ],
    Case(
        "gpu_type with a space",
        ("cluster.gpu_type='a 100'",),
        ("cluster.gpu_type='a 100' is not a GPU type name", "e.g. cluster.gpu_type=a100"),
    ),
    Case(
        "container image an option",
        ("cluster.container.image=--nv",),
        ("cluster.container.image='--nv' is not an image", "docker://"),
    ),
    Case(
        "container mount relative",
        ("cluster.container.mounts=[scratch]",),
        ("cluster.container.mounts holds 'scratch'", "absolute host path"),
    ),
    Case(
        "container mount with a comma",
        ("cluster.container.mounts=['/a,/b']",),
        ("cluster.container.mounts holds '/a,/b'", "without commas"),
    ),
    Case(
        "container option not an option",
        ("cluster.container.options=[cleanenv]",),
        ("cluster.container.options holds 'cleanenv'", "--cleanenv"),
    ),
    Case(
        "container python empty",
        ("cluster.container.image=docker://pytorch/pytorch", "cluster.container.python=''"),
        ("cluster.container.python is empty", "python3"),
    ),
    Case(
        "container image missing",
        ("cluster.container.image={tmp}/no.sif",),
        ("no.sif does not exist", "a docker:// or oras:// address"),
        commands=SUBMIT_ONLY,
    ),
    Case(
        "pyxis on the local backend",
        ("cluster.container.image=docker://pytorch/pytorch", "cluster.container.runtime=pyxis"),
        ("runtime=pyxis runs through srun: it needs the Slurm backend", "runtime=apptainer"),
        commands=SUBMIT_ONLY,
    ),
    Case(
        "expedited requeue on the local backend",
        ("cluster.requeue=expedite",),
        ("cluster.requeue=expedite asks Slurm", "the local backend requeues nothing: drop it"),
        commands=SUBMIT_ONLY,
    ),
    Case(
        "apptainer not here",
        ("cluster.container.image=docker://pytorch/pytorch",),
        ("`apptainer` is not on PATH", "module load apptainer"),
        commands=(("submit",),),
    ),
    Case(
        "mem-per-cpu beside mem_gb",
        ("cluster.sbatch_extra.mem-per-cpu=4G", "cluster.mem_gb=8"),
        ("sets mem-per-cpu and cluster.mem_gb=8 sets --mem", "drop one"),
    ),
    # A line break in a setting would write a shell line of its own into the batch script.
    *[
        Case(
            f"line break in {key}",
            (f'{key}="gpu\\ntouch {{tmp}}/PWNED"',),
            (f"{key}='gpu\\ntouch", "holds the control character '\\n'", "on one line"),
        )
        for key in (
            "cluster.partition",
            "cluster.account",
            "cluster.qos",
            "cluster.constraint",
            "cluster.sbatch_extra.mail-user",
            "output.root",
            "data.root",
        )
    ],
    Case(
        "line break in a setup line",
        ('cluster.setup=["module load cuda\\ntouch {tmp}/PWNED"]',),
        ("cluster.setup='module load cuda\\ntouch", "holds the control character '\\n'"),
    ),
    *[  # unquoted, YAML would fold the line break into a space: refused as written
        Case(
            f"bare line break in {key}",
            (f"{key}=gpu\ntouch {{tmp}}/PWNED",),
            (f"{key}='gpu\\ntouch", "holds the control character '\\n'", "on one line"),
        )
        for key in ("cluster.partition", "data.root")
    ],
    Case(
        "bare line break in a setup line",
        ("cluster.setup=[module load cuda\ntouch {tmp}/PWNED]",),
        ("holds the control character '\\n'",),
    ),
    Case(
        "zero-width space in account",
        ("cluster.account=proj\u200bx",),
        ("cluster.account='proj\\u200bx' holds the invisible character U+200B",),
    ),
    Case(
        "right-to-left mark in partition",
        ("cluster.partition=gpu\u202e",),
        ("holds the invisible character U+202E",),
    ),
    *[
        Case(
            f"epochs written {written}",
            (f"train.epochs={written}",),
            (
                f"train.epochs={written} is a number in a YAML 1.1 form, which reads as {read}",
                "plain decimal digits",
            ),
        )
        for written, read in (("010", 8), ("0x10", 16), ("1_0", 10), ("1:30", 90))
    ],
    Case(
        "empty part of a key",
        ("train..epochs=3",),
        ("'train..epochs=3' is not of the form key=value",),
    ),
    Case(
        "carriage return in qos",
        ('cluster.qos="a\\rb"',),
        ("cluster.qos='a\\rb' holds the control character '\\r'",),
    ),
    Case(
        "line break in a config file",
        ("--config", "{tmp}/injected.yaml"),
        ("cluster.partition='gpu\\ntouch", "holds the control character '\\n'"),
    ),
    *[
        Case(
            f"{written} in cluster.partition",
            (f"cluster.partition={written}",),
            (f"cluster.partition={value!r} is not a Slurm name", "comma-separated"),
        )
        for written, value in (("'a b'", "a b"), ("a'b", "a'b"), ("a#b", "a#b"), ("a$b", "a$b"))
    ],
    *[
        Case(
            f"bool {value}",
            (f"train.checkpoint={value}",),
            (f"train.checkpoint={value} must be true or false",),
        )
        for value in ("-1", "0x10", "2", "0.5")
    ],
    *[
        Case(f"huge {key}", (f"{key}=1000000000000",), (f"{key}=1000000000000 must be between",))
        for key in (
            "cluster.cpus_per_task",
            "cluster.mem_gb",
            "cluster.timeout_min",
            "cluster.signal_delay_s",
            "cluster.max_requeues",
            "dist.timeout_s",
            "train.epochs",
        )
    ],
    Case("mode=xx", ("mode=xx",), ("mode='xx' is not valid; choose one of: dp, ddp",), mode=()),
    Case("--mode xx", (), ("argument --mode: invalid choice: 'xx'",), mode=("--mode", "xx")),
    Case(
        "dp on 2 nodes",
        ("--nodes", "2"),
        (
            "cluster.nodes=2",
            "use DDP for several nodes (--mode ddp; a sweep's --modes ddp; slurm/ddp.sbatch), or one node (--nodes 1; sbatch --nodes=1)",
        ),
        mode=("--mode", "dp"),
    ),
    Case(
        "local on 2 nodes",
        ("--nodes", "2"),
        ("the local backend runs on one machine", "cluster.backend=slurm (or --nodes 1)"),
    ),
    Case(
        "fp16 on CPU",
        ("train.precision=fp16",),
        ("train.precision=fp16 needs CUDA", "use train.precision=bf16"),
        SUBMIT_ONLY,
        skip="" if NO_CUDA else "this machine has CUDA",
    ),
    *[
        Case(
            f"{key} on CPU",
            (f"{key}=true",),
            (f"{key}=true needs a CUDA GPU and none is visible: drop it",),
            SUBMIT_ONLY,
            skip="" if NO_CUDA else "this machine has CUDA",
        )
        for key in ("train.compile", "train.cuda_graph", "data.on_device")
    ],
    *[
        Case(
            f"{key} with DP",
            (f"{key}=true",),
            (f"{key}=true does not apply to DataParallel", "use --mode ddp, or drop it"),
            mode=("--mode", "dp"),
        )
        for key in ("train.compile", "train.cuda_graph")
    ],
    *[
        Case(
            f"{key} in the largest-batch search",
            ("task=largest_batch", f"{key}=true"),
            ("task=largest_batch runs eager steps", f"drop {key}=true for the search"),
        )
        for key in ("train.compile", "train.cuda_graph")
    ],
    Case(
        "compile in the largest-model search",
        ("task=largest_model", "data.dataset=tokens", "model.name=gpt", "train.compile=true"),
        ("task=largest_model runs eager steps", "drop train.compile=true for the search"),
    ),
    Case(
        "largest model of the convnet",
        ("task=largest_model",),
        ("model.name=convnet has no width to search", "add model.name=gpt data.dataset=tokens"),
    ),
    Case(
        "cudnn_benchmark with DP",
        ("train.cudnn_benchmark=true",),
        ("train.cudnn_benchmark=true with DataParallel ran 15× slower", "drop it for DP"),
        mode=("--mode", "dp"),
    ),
    Case(
        "cuda_graph with fp16",
        ("train.cuda_graph=true", "train.precision=fp16"),
        ("cannot capture fp16's gradient scaler", "use train.precision=bf16"),
    ),
    Case(
        "compile_mode without compile",
        ("train.compile_mode=max-autotune-no-cudagraphs",),
        ("only applies to a compiled model", "add train.compile=true"),
    ),
    Case(
        "unknown compile_mode",
        ("train.compile=true", "train.compile_mode=max-autotune"),
        ("train.compile_mode='max-autotune' is not valid", "default, max-autotune-no-cudagraphs"),
    ),
    *[
        Case(
            f"{key} with {mode}",
            (f"{key}=true",),
            (f"{key}=true is not measured with --mode {mode}", "use --mode ddp"),
            mode=("--mode", mode),
        )
        for key in ("train.compile", "train.cuda_graph")
        for mode in ("zero", "fsdp")
    ],
    Case(
        "fp16 with FSDP",
        ("train.precision=fp16",),
        ("train.precision=fp16 with --mode fsdp", "use train.precision=bf16"),
        mode=("--mode", "fsdp"),
    ),
    Case(
        "comm hook with FSDP",
        ("dist.comm_hook=bf16",),
        ("--mode fsdp has none", "use --mode ddp (or zero)"),
        mode=("--mode", "fsdp"),
    ),
    Case(
        "comm hook with DP",
        ("dist.comm_hook=bf16",),
        ("--mode dp has none", "use --mode ddp (or zero)"),
        mode=("--mode", "dp"),
    ),
    Case(
        "comm hook with cuda_graph",
        ("dist.comm_hook=fp16", "train.cuda_graph=true"),
        ("train.cuda_graph", "replaces with the kit's own all-reduce: drop one of them"),
    ),
    Case(
        "unknown comm hook",
        ("dist.comm_hook=int8",),
        ("dist.comm_hook='int8' is not valid", "none, fp16, bf16, powersgd"),
    ),
    Case(
        "unknown mode",
        (),
        ("invalid choice: 'fsdp2'", "choose from 'dp', 'ddp', 'zero', 'fsdp'"),
        mode=("--mode", "fsdp2"),
    ),
    Case(
        "cuda_graph over gloo",
        ("train.cuda_graph=true", "dist.backend=gloo"),
        ("only NCCL can do inside a CUDA graph", "use dist.backend=auto"),
    ),
    Case(
        "nccl on CPU",
        ("dist.backend=nccl",),
        ("dist.backend=nccl needs CUDA", "use dist.backend=gloo"),
        SUBMIT_ONLY,
        skip="" if NO_CUDA else "this machine has CUDA",
    ),
    Case(
        "batch 513 over 4 ranks",
        ("train.global_batch_size=513",),
        ("over 4 rank(s)", "use a multiple of 4, e.g. train.global_batch_size=512"),
    ),
    Case(
        "unknown key",
        ("train.epoch=3",),
        ("unknown setting 'train.epoch'", "Did you mean 'epochs'?"),
    ),
    Case("wrong type", ("train.epochs=abc",), ("train.epochs='abc' must be a whole number",)),
    Case("a number's wrong type", ("train.lr=fast",), ("train.lr='fast' must be a number",)),
    Case(
        "a boolean's wrong type",
        ("train.checkpoint=maybe",),
        ("train.checkpoint='maybe' must be true or false (yes/no, on/off",),
    ),
    Case(
        "root is a file",
        ("output.root={tmp}/file",),
        ("is a file", "Point output.root at a folder"),
        SUBMIT_ONLY,
    ),
    Case(
        "root under a file",
        ("output.root={tmp}/file/sub",),
        ("/file is a file", "Point output.root at a folder"),
        SUBMIT_ONLY,
    ),
    Case(
        "root in a read-only folder",
        ("output.root={tmp}/locked/runs",),
        ("/locked is not writable", *UNWRITABLE),
        SUBMIT_ONLY,
        skip="root ignores the folder's permissions" if os.geteuid() == 0 else "",
    ),
    Case(  # fails for root too: os.access says yes, mkdir says no
        "root under /proc",
        ("output.root=/proc/kit-test-runs",),
        ("output.root=/proc/kit-test-runs", *UNWRITABLE),
        SUBMIT_ONLY,
    ),
    Case("root with a space", ("output.root={tmp}/my runs",), SHELL_CHAR, SUBMIT_ONLY),
    Case("root with a %", ("output.root={tmp}/runs%j",), SHELL_CHAR, SUBMIT_ONLY),
    Case(
        "unknown model",
        ("model.name=resnet",),
        (
            "model.name='resnet' is neither a built-in (convnet, resnet18, gpt)",
            "package.module:function",
        ),
    ),
    Case(
        "unknown dataset",
        ("data.dataset=cifar10",),
        ("data.dataset='cifar10' is neither a built-in (synthetic, mnist, patterns, tokens)",),
    ),
    Case(
        "shape of the digits",
        ("data.image_size=64",),
        ("data.image_size sets the shape of data.dataset=patterns", "add data.dataset=patterns"),
    ),
    Case(
        "patterns too large",
        ("data.dataset=patterns", "data.image_size=1024", "data.train_size=100000"),
        ("is 322 GiB, generated in every rank's memory", "lower data.train_size"),
    ),
    Case(
        "momentum with adamw",
        ("train.optimizer=adamw", "train.momentum=0.5"),
        ("train.momentum is SGD's; train.optimizer=adamw has its own", "drop train.momentum"),
    ),
    Case(
        "weight decay=-1",
        ("train.weight_decay=-1",),
        ("train.weight_decay=-1.0 must be in [0, 1)", "e.g. 0.1"),
    ),
    Case(
        "gpt on the digits",
        ("model.name=gpt",),
        ("model.name=gpt predicts the next token", "add data.dataset=tokens"),
    ),
    Case(
        "tokens for the convnet",
        ("data.dataset=tokens",),
        ("model.name=convnet cannot read", "add model.name=gpt"),
    ),
    Case(
        "size of the convnet",
        ("model.depth=12",),
        ("model.depth sets the shape of model.name=gpt", "add model.name=gpt"),
    ),
    Case(
        "length of the digits",
        ("data.seq_len=64",),
        ("data.seq_len sets the shape of data.dataset=tokens", "add data.dataset=tokens"),
    ),
    Case(
        "a batch larger than the training split",
        ("data.train_size=1000", "train.global_batch_size=2048", "cluster.gpus_per_node=4"),
        (
            "train.global_batch_size=2048 is larger than the 1000 training samples",
            "one step of 1000",
            "use train.global_batch_size=1000",
        ),
        NEW_RUN,
    ),
    Case(
        "a batch larger than real MNIST",
        ("data.dataset=mnist", "train.global_batch_size=65536", "cluster.gpus_per_node=1"),
        (
            "larger than the 60000 training samples of data.dataset=mnist",
            "use train.global_batch_size=60000",
        ),
        NEW_RUN,
    ),
    Case(
        "a training split smaller than the ranks",
        ("data.train_size=3", "train.global_batch_size=8", "cluster.gpus_per_node=4"),
        ("larger than the 3 training samples", "use data.train_size=4 or more"),
        NEW_RUN,
    ),
    Case(
        "channels_last for tokens",
        ("data.dataset=tokens", "model.name=gpt", "train.channels_last=true"),
        ("train.channels_last=true lays out images", "data.dataset=tokens gives token", "drop it"),
    ),
    Case(
        "width over heads",
        ("data.dataset=tokens", "model.name=gpt", "model.width=100", "model.heads=3"),
        ("model.width=100 must split evenly over model.heads=3", "e.g. model.width=99"),
    ),
    Case(
        "tokens too large",
        ("data.dataset=tokens", "model.name=gpt", "data.seq_len=100000", "data.train_size=50000"),
        ("is 45 GiB, generated in every rank's memory", "lower data.train_size or data.seq_len"),
    ),
    Case(
        "no heads", ("data.dataset=tokens", "model.name=gpt", "model.heads=0"), ("model.heads=0",)
    ),
    Case("one class", ("data.dataset=patterns", "data.classes=1"), ("data.classes=1 must be",)),
    Case(
        "model factory not importable",
        ("model.name=no_such_package.models:build",),
        ("cannot import no_such_package.models", "add its folder to PYTHONPATH"),
        SUBMIT_ONLY,
    ),
    Case(
        "model factory missing",
        ("model.name=json:no_such_function",),
        ("json has no attribute named no_such_function", "-> torch.nn.Module"),
        SUBMIT_ONLY,
    ),
    Case(
        "dataset factory not a function",
        ("data.dataset=json.decoder:WHITESPACE",),
        (
            "a Pattern, not a function, named WHITESPACE",
            "function(train: bool) -> (inputs, labels)",
        ),
        SUBMIT_ONLY,
    ),
    Case(
        "model factory of the wrong signature",
        ("model.name=os:getcwd",),
        ("model.name=os:getcwd cannot be called so", "function(sample_shape"),
        SUBMIT_ONLY,
    ),
    # Interpolations are refused, never resolved into config.yaml and run.json (issue 42).
    *[
        Case(
            f"interpolation in {key}",
            (f"{key}={value}",),
            (
                f"{key}={shown!r} holds an interpolation",
                "which the kit does not resolve",
                "write $NAME or \\${NAME}",
            ),
        )
        for key, value, shown in (
            (
                "cluster.setup",
                '["export T=${oc.env:SECRET_TOKEN}"]',
                "export T=${oc.env:SECRET_TOKEN}",
            ),
            ("cluster.setup", '["echo ${HOME}"]', "echo ${HOME}"),
            ("output.name", "${train.epochs}", "${train.epochs}"),
            ("data.root", "${oc.env:PATH}", "${oc.env:PATH}"),
            ("cluster.account", "${oc.decode:x}", "${oc.decode:x}"),
        )
    ],
    Case(
        "interpolation in a config file",
        ("--config", "{tmp}/interpolated.yaml"),
        ("cluster.partition='${oc.env:HOME}' holds an interpolation",),
    ),
    Case(
        "a key given twice",
        ("train.epochs=2", "train.epochs=3"),
        ("train.epochs=2 and train.epochs=3 both set train.epochs", "give each setting once"),
    ),
    Case(
        "a group and a key in it",
        ("cluster.sbatch_extra={mail-type: END}", "cluster.sbatch_extra.mail-type=ALL"),
        ("both set cluster.sbatch_extra", "give each setting once"),
    ),
    Case(
        "--mode against mode=",
        ("mode=ddp",),
        ("--mode dp and mode=ddp both set mode", "give one of them"),
        mode=("--mode", "dp"),
    ),
    Case(
        "--nodes against cluster.nodes=",
        ("--nodes", "2", "cluster.nodes=1"),
        ("--nodes 2 and cluster.nodes=1 both set cluster.nodes", "give one of them"),
    ),
    Case(
        "a setup line split at a comma",
        ("cluster.setup=[export A=1,2]",),
        ("reads as two lines, 'export A=1' and '2'", "cluster.setup=['export A=1,2']"),
    ),
    Case(
        "a factory module that is not there, for the sbatch scripts",
        ("data.dataset=nosuchmod:data",),
        ("data.dataset=nosuchmod:data: cannot import nosuchmod",),
        NEW_RUN,
    ),
    Case(
        "an indexed key",
        ("cluster.setup[0]=x",),
        ("cluster.setup[0]: the kit sets no single item of a list", "'cluster.setup=[x]'"),
    ),
    *[
        Case(
            f"a name over 255 bytes in {key}",
            (f"{key}={{tmp}}/{LONG}",),
            (f"/{LONG}: a name in this path is longer than the file system takes", "shorten it"),
            commands,
        )
        for key, commands in (("output.root", SUBMIT_ONLY), ("data.root", NEW_RUN))
    ],
    Case(
        "a name over 255 bytes in --config",
        ("--config", f"{{tmp}}/{LONG}.yaml"),
        (f"/{LONG}.yaml: a name in this path is longer than the file system takes",),
    ),
    Case("missing config", ("--config", "{tmp}/missing.yaml"), ("missing.yaml does not exist",)),
    Case("config folder", ("--config", "{tmp}/locked"), ("/locked is a folder: name a YAML file",)),
    Case(
        "invalid YAML",
        ("--config", "{tmp}/broken.yaml"),
        ("broken.yaml is not valid YAML", "at line 2, column 1"),
    ),
    Case(
        "YAML list",
        ("--config", "{tmp}/list.yaml"),
        ("list.yaml must hold a mapping of settings", "not a single value or a list"),
    ),
    Case(
        "YAML number",
        ("--config", "{tmp}/number.yaml"),
        ("number.yaml must hold a mapping of settings", "lines of `key: value`"),
    ),
    Case(  # read, it would wait for a writer for ever
        "config a named pipe",
        ("--config", "{tmp}/pipe.yaml"),
        ("pipe.yaml is not a regular file", "name a YAML file"),
    ),
    Case("config not UTF-8", ("--config", "{tmp}/latin1.yaml"), ("latin1.yaml is not UTF-8 text",)),
]


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    """A folder holding what the cases point at: a file, a read-only folder, bad configs."""
    (tmp_path / "file").write_text("not a folder\n")
    (tmp_path / "broken.yaml").write_text("train: [epochs: 3\n")
    (tmp_path / "list.yaml").write_text("- train.epochs=3\n- train.lr=0.1\n")
    (tmp_path / "number.yaml").write_text("42\n")
    (tmp_path / "injected.yaml").write_text('cluster:\n  partition: "gpu\\ntouch PWNED"\n')
    (tmp_path / "interpolated.yaml").write_text("cluster:\n  partition: ${oc.env:HOME}\n")
    (tmp_path / "latin1.yaml").write_bytes("output:\n  name: caf\xe9\n".encode("latin-1"))
    os.mkfifo(tmp_path / "pipe.yaml")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    yield tmp_path
    locked.chmod(0o700)


def _params() -> list[object]:
    return [
        pytest.param(
            case,
            command,
            id=f"{case.id}-{'-'.join(command)}",
            marks=[pytest.mark.skip(reason=case.skip)] if case.skip else [],
        )
        for case in CASES
        for command in case.commands
    ]


@pytest.mark.parametrize(("case", "command"), _params())
def test_bad_input_is_one_line_that_names_the_fix(
    tmp: Path, case: Case, command: tuple[str, ...]
) -> None:
    before = _listing(tmp)
    args = [arg.replace("{tmp}", str(tmp)) for arg in case.args]
    done = kit_here("launch", *command, *case.mode, *_defaults_unless_set(tmp, args), *args)
    message = one_error_line(done)
    for fragment in case.fragments:
        assert fragment in message
    assert done.stdout == ""  # no "submitted job", no run folder announced
    assert _listing(tmp) == before  # output.root, data.root: nothing made
    assert not Path("/proc/kit-test-runs").exists()


def _defaults_unless_set(tmp: Path, args: list[str]) -> list[str]:
    """Where the catalogue's runs go, less what a case sets itself (a key is given once)."""
    defaults = ["cluster.backend=local", f"output.root={tmp}/runs", f"data.root={tmp}/data"]
    return [d for d in defaults if not any(a.startswith(d.split("=")[0] + "=") for a in args)]


# The catalogue runs each command's `main` in this interpreter (tests/kit.py: kit_here): these
# cases show that a real process prints the same, with the same exit code.
SAME_IN_A_PROCESS = ("lr=-1", "mode=xx", "dp on 2 nodes", "model factory not importable")


@pytest.mark.parametrize(
    ("case", "command"),
    [(c, command) for c in CASES if c.id in SAME_IN_A_PROCESS for command in c.commands],
    ids=lambda value: value.id if isinstance(value, Case) else "-".join(value),
)
def test_a_real_process_says_what_the_catalogue_saw(
    tmp: Path, case: Case, command: tuple[str, ...]
) -> None:
    args = ("launch", *command, *case.mode, *_defaults_unless_set(tmp, [*case.args]), *case.args)
    here, there = kit_here(*args), kit(*args)
    assert (there.returncode, there.stdout, _own(there.stderr)) == (
        here.returncode,
        here.stdout,
        _own(here.stderr),
    )
    assert there.returncode == 2


def _own(message: str) -> str:
    """The message less the Python path it quotes, which is each interpreter's own."""
    return message.split("Python path here:")[0]


@pytest.mark.parametrize("command", [("submit",), ("prepare",), ("config",)])
def test_a_token_in_the_environment_is_never_written_in_clear(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    """`${oc.env:SECRET_TOKEN}` in a setup line once put the token's value into config.yaml
    and run.json (mode 0644): refused now, naming the shell's way, and the value is nowhere."""
    token = "s3cr3t-t0ken-value"
    done = kit_here(
        "launch", *command, "--mode", "ddp", "cluster.backend=local",
        f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data",
        'cluster.setup=["export T=${oc.env:SECRET_TOKEN}"]', env={"SECRET_TOKEN": token},
    )  # fmt: skip
    message = one_error_line(done)
    assert "write $NAME or \\${NAME}" in message and token not in message
    assert token not in done.stdout and _listing(tmp_path) == []


def test_empty_output_name_means_the_default(tmp_path: Path) -> None:
    done = kit(
        "launch",
        "submit",
        "--mode",
        "ddp",
        "cluster.backend=local",
        f"output.root={tmp_path}/runs",
        f"data.root={tmp_path}/data",
        "output.name=",
        "--dry-run",
    )
    assert done.returncode == 0, done.stderr
    folder = done.stdout.splitlines()[0].rsplit("/", 1)[1]
    assert folder.split("-")[2:4] == ["ddp", "1n4g"] and len(folder.split("-")) == 5, folder
    assert _listing(tmp_path) == []


# --- run folders that status cannot read ---------------------------------------------------


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        ("[1, 2]\n", ("run.json is not a run record of this kit",)),
        (
            '{"schema": 99, "run_id": "x"}\n',
            ("run.json has schema 99, newer than this kit's 1", "pip install -U"),
        ),
        ("{not json\n", ("run.json cannot be read", "the run folder is damaged")),
        (None, ("is not a run folder (no run.json)",)),
    ],
    ids=["list", "schema-99", "not-json", "no-run-json"],
)
def test_status_of_one_unreadable_folder_is_an_error(
    tmp_path: Path, content: str | None, fragments: tuple[str, ...]
) -> None:
    folder = tmp_path / "runs" / "20260101-000000-ddp-1n4g-beef"
    folder.mkdir(parents=True)
    if content is not None:
        (folder / "run.json").write_text(content)
    before = _listing(tmp_path)
    message = one_error_line(kit("launch", "status", str(folder)))
    assert all(fragment in message for fragment in fragments), message
    assert _listing(tmp_path) == before


def test_status_shows_the_good_run_next_to_a_bad_one(tmp_path: Path) -> None:
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs", "cluster.backend=local"])
    good = runfolder.create(cfg, launcher="launch", backend="local", command=["test"])
    runfolder.RecordWriter(good, 0).write("summary", total_seconds=61)
    bad = tmp_path / "runs" / "zz-damaged"
    bad.mkdir()
    (bad / "run.json").write_text("[1, 2]\n")
    done = kit("launch", "status", "--root", f"{tmp_path}/runs")
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert rows[0][:5] == ["RUN", "MODE", "BACKEND", "JOB", "STATE"]
    assert [good.name, "ddp", "local", "-", "COMPLETED", "-", "00:01:01", "-"] in rows
    assert [row[:5] for row in rows if row[0] == bad.name] == [
        [bad.name, "-", "-", "-", "UNREADABLE"]
    ]
    (warning,) = done.stderr.splitlines()
    assert warning.startswith("warning: ") and f"{bad}/run.json is not a run record" in warning


@pytest.mark.parametrize("where", ["a name over 255 bytes", "a folder this user cannot enter"])
@pytest.mark.parametrize(
    "command",
    [("launch", "status"), ("launch", "logs"), ("launch", "cancel"), ("analysis", "summarize")],
)
def test_a_run_path_the_system_refuses_is_one_line(
    tmp_path: Path, where: str, command: tuple[str, ...]
) -> None:
    if where.endswith("enter") and os.geteuid() == 0:
        pytest.skip("root enters a folder of any mode")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0)
    path = tmp_path / LONG if where.startswith("a name") else locked / "run"
    try:
        message = one_error_line(kit_here(*command, str(path)))
    finally:
        locked.chmod(0o700)
    fix = "shorten it" if where.startswith("a name") else "pick a path this user can reach"
    assert message.startswith(f"error: {path}") and fix in message, message


def test_status_of_an_empty_root_says_how_to_submit(tmp_path: Path) -> None:
    message = one_error_line(kit("launch", "status", "--root", str(tmp_path)))
    assert f"no runs under {tmp_path}" in message and "python -m launch submit" in message


# --- data ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_fetch_mnist_without_internet_fails_fast_and_leaves_nothing(tmp_path: Path) -> None:
    done = kit("train", "fetch-mnist", "--root", f"{tmp_path}/data", timeout=120)
    if done.returncode == 0:
        pytest.skip("this machine reaches the MNIST mirrors")
    message = one_error_line(done)
    assert "could not download MNIST" in message
    assert f"fetch-mnist --root {tmp_path}/data` on a machine with internet" in message
    assert _listing(tmp_path) == []


def _mnist_files(root: Path, short_labels: bool = False, bad_label: int | None = None) -> None:
    """MNIST-format IDX files of synthetic digits, damaged as asked."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 20), ("test", 10)):
        images, labels = synthetic_digits(count, rng)
        if short_labels and split == "test":
            labels = labels[:-1]
        if bad_label is not None and split == "train":
            labels[3] = bad_label
        _write_idx(root / "MNIST" / "raw", split, images, labels)


@pytest.mark.parametrize(
    ("short_labels", "bad_label", "fragments"),
    [
        (
            True,
            None,
            (
                "the test split has 10 images (t10k-images-idx3-ubyte) but 9 labels "
                "(t10k-labels-idx1-ubyte)",
                "fetch-mnist --root",
            ),
        ),
        (
            False,
            10,
            ("train-labels-idx1-ubyte holds label 10; digits are 0–9", "fetch-mnist --root"),
        ),
    ],
    ids=["counts-differ", "label-10"],
)
def test_prepare_data_names_the_damaged_file(
    tmp_path: Path, short_labels: bool, bad_label: int | None, fragments: tuple[str, ...]
) -> None:
    root = tmp_path / "mnist"
    _mnist_files(root, short_labels, bad_label)
    before = _listing(tmp_path)
    message = one_error_line(
        kit("train", "prepare-data", "data.dataset=mnist", f"data.root={root}")
    )
    assert all(fragment in message for fragment in fragments), message
    assert str(root / "MNIST" / "raw") in message
    assert _listing(tmp_path) == before


def test_sound_mnist_files_pass_the_check(tmp_path: Path) -> None:
    """The control for the two above: the same files, undamaged, are accepted."""
    _mnist_files(tmp_path)
    done = kit("train", "prepare-data", "data.dataset=mnist", f"data.root={tmp_path}")
    assert done.returncode == 0, done.stderr
    assert "MNIST is in place" in done.stdout


@pytest.fixture
def read_only_run(tmp_path: Path) -> Iterator[Path]:
    """A run folder (made, never run) on a read-only bind mount of itself; needs root."""
    cfg = load_config(overrides=[f"output.root={tmp_path}", "cluster.backend=local"])
    run_dir = runfolder.create(cfg, launcher="launch", backend="local", command=[])
    mount = ["mount", "--bind", str(run_dir), str(run_dir)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("a read-only mount needs root")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(run_dir)], check=True)
        yield run_dir
    finally:
        subprocess.run(["umount", str(run_dir)], check=True)


def test_resume_into_a_read_only_run_folder_is_one_line(read_only_run: Path) -> None:
    before = sorted(p.name for p in read_only_run.rglob("*"))
    done = kit("launch", "resume", str(read_only_run))
    message = one_error_line(done)
    assert f"{read_only_run} is not writable here" in message and "resume the copy" in message
    assert sorted(p.name for p in read_only_run.rglob("*")) == before


@pytest.fixture
def unreachable_job(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A run folder of Slurm job 4242, and an environment whose Slurm controller nobody runs
    (scancel fails in about a second)."""
    if not shutil.which("scancel"):
        pytest.skip("no Slurm client here")
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs", "cluster.backend=slurm"])
    run_dir = runfolder.create(cfg, launcher="launch", backend="slurm", command=[])
    runfolder.update_meta(run_dir, job_id="4242")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=gone\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\n")
    return run_dir, {"SLURM_CONF": str(conf)}


def test_a_cancel_scancel_failed_leaves_the_run_uncancelled(
    unreachable_job: tuple[Path, dict[str, str]],
) -> None:
    """scancel cannot reach the controller: one line saying the job was not cancelled, and the
    run is not marked, so the job still saves at its time limit (a marked job would not)."""
    run_dir, env = unreachable_job
    message = one_error_line(kit("launch", "cancel", str(run_dir), env=env))
    assert "scancel 4242 failed" in message and "the job was not cancelled" in message
    assert not runfolder.read_meta(run_dir).get("cancel_requested")


def test_a_factory_module_that_exits_on_import_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "quits.py").write_text(
        "import sys\n\nsys.exit(0)\n\ndef build(shape, classes): ...\n"
    )
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", "cluster.backend=local"]
    path = os.pathsep.join([str(tmp_path), str(REPO)])
    done = kit("launch", "submit", "model.name=quits:build", *where, env={"PYTHONPATH": path})
    message = one_error_line(done)
    assert "importing quits ended the program (sys.exit(0))" in message
    assert "if __name__" in message and not (tmp_path / "runs").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("import time\n\ntime.sleep(3600)\n", "importing stalls took over 1 s and was stopped"),
        ("raise KeyboardInterrupt\n", "importing stalls raised KeyboardInterrupt itself"),
    ],
    ids=["hangs", "raises-KeyboardInterrupt"],
)
def test_a_factory_module_that_hangs_or_interrupts_on_import_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, said: str
) -> None:
    """`launch submit` waited for ever on a module that hangs as it is imported, and called a
    module's own KeyboardInterrupt a Ctrl-C ("interrupted"): one line each now."""
    from slurm_ddp_kit.core import factories

    (tmp_path / "stalls.py").write_text(code + "\ndef build(shape, classes): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(factories, "IMPORT_S", 1.0)
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", "cluster.backend=local"]
    message = one_error_line(kit_here("launch", "submit", "model.name=stalls:build", *where))
    assert said in message and 'if __name__ == "__main__"' in message
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("kind", ["a named pipe", "a folder"])
def test_a_state_that_is_no_file_is_refused_not_started_over(tmp_path: Path, kind: str) -> None:
    """A resume that found state.pt to be a pipe or a folder started the run over from epoch 1,
    dropping what was trained: refused in one line, and the state left as it is."""
    cfg = load_config(overrides=[f"output.root={tmp_path}/runs", "cluster.backend=local"])
    run_dir = runfolder.create(cfg, launcher="launch", backend="local", command=[])
    state = runfolder.state_path(run_dir)
    state.parent.mkdir()
    os.mkfifo(state) if kind == "a named pipe" else state.mkdir()
    message = one_error_line(kit_here("launch", "resume", str(run_dir)))
    assert f"{state} is not a regular file" in message and "remove it to start the run" in message
    assert runfolder.read_meta(run_dir)["job_id"] is None  # nothing submitted
    assert state.exists() and not runfolder.metrics_path(run_dir, 0).exists()


@pytest.mark.timeout(300)
def test_a_model_with_nothing_to_train_and_a_single_class_are_said(tmp_path: Path) -> None:
    """The CPU trial passed a model with no trainable parameters (DDP then failed in every
    rank), and all labels 0 trained to "100.00 %" without a word."""
    (tmp_path / "userwork.py").write_text(
        "import torch\n\n"
        "def frozen(shape, classes):\n"
        "    m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(classes))\n"
        "    m(torch.zeros(1, *shape))\n"
        "    return m.requires_grad_(False)\n\n"
        "def zeros(train):\n"
        "    n = 64 if train else 16\n"
        "    return torch.rand(n, 1, 8, 8), torch.zeros(n, dtype=torch.long)\n"
    )
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", "cluster.backend=local"]
    env = {
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
        "XDG_CACHE_HOME": str(tmp_path),
    }
    frozen = kit("launch", "submit", "--dry-run", "model.name=userwork:frozen", *where, env=env)
    message = one_error_line(frozen)
    assert "model.name=userwork:frozen returned a model with no trainable parameters" in message
    zeros = ("data.dataset=userwork:zeros", "model.name=convnet")
    done = kit("launch", "submit", "--dry-run", *zeros, *where, env=env)
    assert "gave labels of one class only (0)" in done.stderr, done.stderr


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A folder on a 64 kB file system (a tmpfs of its own): room for the folders, not the data."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("mounting a small file system needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_prepare_data_on_a_full_disk_is_one_line_and_leaves_nothing(full_disk: Path) -> None:
    done = kit("train", "prepare-data", f"data.root={full_disk}/data", "data.train_size=2000")
    message = one_error_line(done)
    assert "could not write the synthetic digits" in message and "No space left" in message
    assert "free space there, or point data.root at another folder" in message
    assert [p.name for p in (full_disk / "data").iterdir()] == []  # no partial copy


def test_verbose_shows_the_slurm_commands_it_runs(
    unreachable_job: tuple[Path, dict[str, str]],
) -> None:
    run_dir, env = unreachable_job
    done = kit_here("launch", "cancel", "-v", str(run_dir), env=env)
    assert done.returncode == 2, done.stderr
    assert "slurm: scancel -v -- 4242" in done.stderr and "slurm: scancel: exit " in done.stderr


def _in_the_background(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    """`launch submit …` as a script's `… &` starts it: SIGINT ignored; in a process group of
    its own here (the job's controller and ranks join it), so that the test's SIGINT to that
    group reaches nothing else. Its output in a file: the controller holds inherited pipes."""
    with (tmp_path / "submit.log").open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "launch", "submit", *args],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *_pythonpath()])},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )


def _pythonpath() -> list[str]:
    return [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []


def _group_left(pgid: int) -> list[int]:
    """The processes still in the process group (from /proc)."""
    left = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.getpgid(int(entry)) == pgid:
                left.append(int(entry))
    return left


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigint_to_a_local_jobs_process_group_ends_each_rank_in_one_line(tmp_path: Path) -> None:
    """The terminal's Ctrl-C reaches a job started in the background (`launch submit … &`, no
    --wait) through its process group: each rank once from the terminal, once more from the
    controller that passes it on. The second broke into the first one's unwinding: no error
    recorded, and a rank log ending in tracebacks chained to tracebacks. Now each rank records
    the interrupt and its log ends in one line."""
    where = [f"output.root={tmp_path}/runs", f"data.root={tmp_path}/data", "cluster.backend=local"]
    launcher = _in_the_background(
        tmp_path, "--mode", "ddp", "cluster.gpus_per_node=2", *LASTING, "train.epochs=50", *where
    )
    try:
        assert launcher.wait(120) == 0, (tmp_path / "submit.log").read_text()
        run_dir = run_folder((tmp_path / "submit.log").read_text())
        first = runfolder.metrics_path(run_dir, 0)
        assert wait_for(lambda: first.is_file() and '"epoch"' in first.read_text(), 120)
        os.killpg(launcher.pid, signal.SIGINT)
        assert wait_for(lambda: not _group_left(launcher.pid), 30), "the job did not end"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    for rank in (0, 1):
        (log,) = runfolder.logs_dir(run_dir).glob(f"*_{rank}_log.err")
        assert "Traceback" not in log.read_text(), log.read_text()
        assert log.read_text().splitlines()[-1] == (
            "interrupted: this task ended on SIGINT (a Ctrl-C, or the job's cancel)"
        )
    status = kit_here("launch", "status", str(run_dir))
    assert status.stdout.splitlines()[-1].endswith(
        "KeyboardInterrupt: interrupted by SIGINT (a Ctrl-C, or a cancel, reached this rank); "
        f"`python -m launch resume {run_dir}` goes on from its last checkpoint"
    ), status.stdout
    assert "Traceback" not in kit_here("launch", "logs", str(run_dir)).stdout
