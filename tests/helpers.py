"""Test helpers shared by the test files: small prepared datasets written directly in the on-disk format of
docs/data.md, a module run as a user runs it, a run's metrics, weight comparisons, waits on a running process, the
outputs the docs quote."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _tokenizer(vocab_size: int, path: Path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer=trainer)
    tok.save(str(path))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_prepared(out: Path, *, num_sequences: int, seq_len: int, vocab_size: int, seed: int = 0,
                  rows_per_shard: int = 200) -> Path:
    """Sequences drawn from a few repeating token patterns, so a tiny model's loss falls quickly.

    Written by hand (numpy and json, not minilm.packing): raw little-endian uint16 token files of
    rows_per_shard rows and the manifest that lists them.
    """
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    patterns = rng.integers(3, vocab_size, size=(8, 24))
    rows = np.stack([np.resize(np.roll(patterns[i % 8], i), seq_len + 1) for i in range(num_sequences)])
    rows = rows.astype("<u2")
    shards = []
    for k, start in enumerate(range(0, num_sequences, rows_per_shard)):
        part = rows[start:start + rows_per_shard]
        name = f"shard-{k:05d}.bin"
        (out / name).write_bytes(part.tobytes())
        shards.append({"file": name, "first_sample_id": start, "num_sequences": len(part), "bytes": part.nbytes,
                       "sha256": hashlib.sha256(part.tobytes()).hexdigest()})
    tok_sha = _tokenizer(vocab_size, out / "tokenizer.json")
    fingerprint = hashlib.sha256(json.dumps([tok_sha, seq_len, [s["sha256"] for s in shards]]).encode()).hexdigest()
    manifest = {"format": "minilm-packed-v2", "seq_len": seq_len, "token_dtype": "uint16",
                "num_sequences": num_sequences, "num_tokens": num_sequences * (seq_len + 1), "shards": shards,
                "tokenizer": {"path": "tokenizer.json", "sha256": tok_sha, "vocab_size": vocab_size,
                              "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0},
                "fingerprint": fingerprint}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def reference_rows(path: Path) -> np.ndarray:
    """Every row of a uint16 prepared dataset, read from its token files by hand (not through minilm.data)."""
    m = json.loads((path / "manifest.json").read_text())
    return np.concatenate([np.fromfile(path / s["file"], "<u2").reshape(-1, m["seq_len"] + 1) for s in m["shards"]])


def run_module(module: str, args: list[str], env: dict | None = None, timeout: float = 300,
               check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # where its processes wait, and what it printed, say where it hung
        stacks = stack_dumps(proc.pid)
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{module} ran past {timeout} s\nstacks:\n{stacks}\nstderr:\n{err[-2000:]}\n"
                             f"stdout:\n{out[-2000:]}") from None
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} exited {proc.returncode}\nstdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def stack_dumps(driver_pid: int) -> str:
    """The Python stacks (py-spy, from the dev extra) of a hung driver and of its Ray processes that run user code
    (a Tune trial, a Train controller, worker or sync actor, the scoring): the threads in our code, Train's or Tune's."""
    import psutil

    ours = ("ImplicitFunc", "_QueueActor", "Train", "SynchronizationActor", "DatasetManager", "Evaluat", "score")
    titles = {driver_pid: "driver"} | {p.pid: p.info["cmdline"][0] for p in psutil.process_iter(["cmdline"])
                                       if any(w in " ".join(p.info["cmdline"] or [])[:60] for w in ours)}
    dumps = []
    for pid, title in titles.items():
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            dump = subprocess.run([Path(sys.executable).with_name("py-spy"), "dump", "--pid", str(pid)],
                                  capture_output=True, text=True, timeout=30).stdout
            threads = [t for t in dump.split("\nThread ")[1:]
                       if any(w in t for w in ("minilm", "ray_jobs", "(active)", "ray/train", "ray/tune"))]
            dumps.append(f"== {pid} {title}\n" + "\n".join("Thread " + t.strip() for t in threads))
    return "\n".join(dumps)


def metrics(run_dir: Path) -> list[dict]:
    """The records of a run folder's metrics.jsonl, every line one JSON object."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def max_rel_diff(got: dict, want: dict) -> float:
    """The largest difference of any tensor, relative to the largest magnitude of `want`'s (the reference's)."""
    assert got.keys() == want.keys()
    return max(((got[k].float() - want[k].float()).abs().max() / want[k].float().abs().max().clamp_min(1e-12)).item()
               for k in got)


def trained_state():
    """A tiny model one optimizer step in (so the AdamW state is not empty), its optimizer and fp32 scaler."""
    import torch

    from minilm.config import ModelConfig, TrainConfig
    from minilm.model import MiniMindForCausalLM
    from minilm.step import make_grad_scaler, make_optimizer, optimizer_step

    torch.manual_seed(0)
    model = MiniMindForCausalLM(ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))
    optimizer, scaler = make_optimizer(model, TrainConfig()), make_grad_scaler(torch.float32, "cpu")
    optimizer_step(model, optimizer, scaler, [torch.randint(0, 256, (2, 17))], lr=1e-3, grad_clip=1.0)
    return model, optimizer, scaler


def bitwise_equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class NoHostReads:
    """Fails any Python-level read of a tensor's value (`bool`, `item`, `tolist`, `float`, `int`): on a GPU each
    one would make the host wait for the queued kernels."""

    NAMES = ("__bool__", "item", "tolist", "__float__", "__int__", "__index__")

    def __enter__(self):
        import torch

        self.saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}

        def refuse(name):
            def read(t, *args, **kwargs):
                raise AssertionError(f"the step read a tensor back to the host ({name})")
            return read

        for name in self.NAMES:
            setattr(torch.Tensor, name, refuse(name))
        return self

    def __exit__(self, *exc):
        import torch

        for name, f in self.saved.items():
            setattr(torch.Tensor, name, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def sigterm_kept():
    """minilm.train installs its own SIGTERM handler: the test process's is put back afterwards."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler)


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 240, poll: float = 0.1) -> None:
    """Poll `condition()` until it is true; fail naming `what` if the process ends or time runs out first."""
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            out = proc.stdout.read()[-3000:] if proc.stdout else ""
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}\n{out}")
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def matches(text: str, pattern: str) -> bool:
    """`pattern` with each "…" standing for any text."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("…"))), text, re.DOTALL) is not None


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def tree(folder: Path) -> dict[str, tuple[int, int, bytes] | None]:
    """Every file under `folder` with its size, mtime and first bytes, and every folder: what 'untouched' compares."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, head(p)) if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(64)


# ---- what the docs quote (tests/test_documented_commands.py) ----

def quoted_block(doc: str, first: str) -> list[str]:
    """The lines of a code block of `doc` from the one that starts with `first` on, their common indent removed."""
    lines, block = (ROOT / doc).read_text().splitlines(), []
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first) and line.startswith("    "))
    indent = len(lines[start]) - len(lines[start].lstrip())
    for line in lines[start:]:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break
        block.append(line[indent:].rstrip())
    return [line for line in block if line]


def output_form(line: str) -> str:
    """A console line with what changes from run to run masked: quoted text, paths, durations, numbers, dtypes and
    the optimizer (`--optimizer auto` picks by the machine's own timings)."""
    line = re.sub(r"'[^']*'|\"[^\"]*\"", "Q", line)
    line = re.sub(r"\S*[/~]\S*", "P", line)
    line = re.sub(r"\b(bfloat16|float32|float16)\b", "D", line)
    line = re.sub(r"\b(muon|adamw)\b", "O", line)
    line = re.sub(r"\b\d+(\.\d+)?(h\d+m|m\d+s|s)\b", "T", line)
    line = re.sub(r"\d[\d,]*(\.\d+)?(e[+-]\d+)?", "N", line)
    return " ".join(line.split())


def assert_quoted(quoted: list[str], printed: str) -> None:
    """Each quoted line (but `...`) is, in `output_form`, a line of what the command printed."""
    printed_forms = {output_form(line) for line in printed.splitlines()}
    missing = [line for line in quoted if line.strip() != "..." and output_form(line) not in printed_forms]
    assert not missing, f"quoted but not printed in this form: {missing}\nprinted:\n{printed[-3000:]}"


def save_resume_state(path, *, model, optimizer, scaler, state: dict, hooks=None) -> Path:
    """A complete resume checkpoint of a live model, optimizer and scaler (what the manager writes from a snapshot)."""
    from minilm import checkpoint as C

    live = C.ResumeState(C.model_tensors(model.state_dict()), optimizer.state_dict(), scaler.state_dict(), state)
    return C.write_resume_state(path, live, hooks)


def write_marker(path, files) -> None:
    """A COMPLETE.json vouching for `files` as they are now: an edited checkpoint made to look whole."""
    from minilm import checkpoint as C

    marker = {"kind": "checkpoint", "files": {name: C.file_sha256(Path(path) / name) for name in files}}
    (Path(path) / C.MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True))
