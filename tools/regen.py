"""``dflash-regen``: have the target answer prompts, as training data for its drafter.

    dflash-regen --prompts prompts.jsonl --out data/regen.jsonl --config configs/demo.toml
    dflash-regen --prompts prompts.jsonl --out data/regen.jsonl --model Qwen/Qwen3-8B --batch-size 32
    dflash-regen --prompts prompts.jsonl --out data/regen.jsonl --base-url http://gpu-host:8000/v1 --concurrency 64

A drafter learns to predict what the *target* would say. Answers written by
someone else (a human, a stronger model) teach it a distribution the target
does not follow, which costs acceptance at inference; regenerating the answers
with the target itself closes that gap.

Each line of ``--prompts`` is ``{"messages": [...]}`` (the conversation is cut
after its last user turn; later assistant turns are dropped) or
``{"prompt": "..."}`` (one user turn). Each line written to ``--out`` is
``{"messages": [..., {"role": "assistant", "content": ANSWER}], "prompt_line":
N, "finish_reason": "stop" | "length"}``, which the target server reads as
``data.source`` (extra keys are ignored).

Generation is batched (left padding), greedy unless ``--temperature`` > 0,
and resumable: lines already in ``--out`` are kept and their prompts skipped,
a line cut short by a kill is dropped, and every batch is flushed to disk
before the next starts. Rerun the same command after an interruption.

With ``--base-url`` the target is not loaded here: an OpenAI-compatible server
(vLLM, SGLang, ``transformers serve``, ...) answers, ``--concurrency``
requests at a time, with retries, and the records are the same
(``tools/regen_client.py`` says how it works). ``--model`` is then the served
model's name (default: the only one the server lists); ``--config``, ``--set``,
``--batch-size`` and ``--threads`` are for the in-process mode only.

Exit status: 0 done (with ``--base-url``: prompts that failed are listed and
skipped, a rerun tries them again), 1 the server did not answer, stopped
answering, or answered none of the prompts (what was answered is kept; rerun
to resume), 2 bad arguments, config, model or files, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from common import cli
from tools.regen_prompts import Messages, Prompt, RegenError, read_prompts  # noqa: F401 (re-exported)

logger = logging.getLogger("tools.regen")

def resume_state(out: Path, prompts: Sequence[Prompt]) -> set[int]:
    """Prompt lines already answered in ``out``.

    A last line without its newline (the process was killed while writing it)
    is cut off. A record whose prompt is not the prompt on its line means
    ``out`` was made from another prompts file: that is refused.
    """
    if not out.exists():
        return set()
    by_line = {p.line: p.messages for p in prompts}
    with open(out, "rb") as f:
        data = f.read()
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        logger.warning("[regen] %s ends with a partial line (%d bytes, interrupted write): dropping it",
                       out, len(data) - complete)
        with open(out, "r+b") as f:
            f.truncate(complete)
    done: set[int] = set()
    for lineno, text in enumerate(data[:complete].decode("utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
            line, messages = int(record["prompt_line"]), record["messages"][:-1]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError):
            raise RegenError(f"{out}:{lineno} is not a dflash-regen record; pass another --out") from None
        if by_line.get(line) != messages:
            raise RegenError(f"{out}:{lineno} answers a prompt that is not line {line} of the prompts file: "
                             f"{out} was made from other prompts; pass another --out or delete it")
        if line in done:
            raise RegenError(f"{out}:{lineno}: prompt line {line} is answered twice")
        done.add(line)
    return done


# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------


def answer_batch(
    model: Any,
    tokenizer: Any,
    batch: Sequence[Messages],
    *,
    max_new_tokens: int,
    temperature: float,
    stop_ids: Sequence[int],
    pad_token_id: int,
    seed: int,
) -> list[tuple[str, str, int]]:
    """``(answer, finish_reason, new tokens)`` per conversation, generated in one batch."""
    import torch

    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in batch]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation continues at the right edge of every row
    try:
        enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = side
    device = model.get_input_embeddings().weight.device
    enc = {k: v.to(device) for k, v in enc.items()}
    kwargs: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        kwargs["temperature"] = temperature
        kwargs["top_k"] = 0
        kwargs["top_p"] = 1.0
        torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                             eos_token_id=list(stop_ids) or None, **kwargs)
    new = out[:, enc["input_ids"].shape[1]:].tolist()
    stops = set(stop_ids)
    answers = []
    for row in new:
        end = next((i for i, t in enumerate(row) if t in stops), None)
        tokens = row if end is None else row[:end]
        answers.append((tokenizer.decode(tokens, skip_special_tokens=True).strip(),
                        "length" if end is None else "stop", len(tokens) + (end is not None)))
    return answers


def regenerate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    out: Path,
    *,
    batch_size: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    pad_token_id: int = 0,
) -> dict[str, int]:
    """Answer every prompt not yet in ``out`` and append the records; returns counts."""
    done = resume_state(out, prompts)
    todo = [p for p in prompts if p.line not in done]
    if done:
        logger.info("[regen] resuming: %d of %d prompts already answered in %s", len(done), len(prompts), out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    new_tokens = written = 0
    with open(out, "a", encoding="utf-8") as f:
        for first in range(0, len(todo), batch_size):
            batch = todo[first : first + batch_size]
            answers = answer_batch(model, tokenizer, [p.messages for p in batch], max_new_tokens=max_new_tokens,
                                   temperature=temperature, stop_ids=stop_ids, pad_token_id=pad_token_id,
                                   seed=seed + batch[0].line)
            for prompt, (answer, finish, count) in zip(batch, answers):
                record = {"messages": [*prompt.messages, {"role": "assistant", "content": answer}],
                          "prompt_line": prompt.line, "finish_reason": finish}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                new_tokens += count
            f.flush()
            os.fsync(f.fileno())  # a batch is durable before the next one starts
            written += len(batch)
            elapsed = time.monotonic() - started
            total_done = len(done) + written
            eta = elapsed / written * (len(todo) - written)
            logger.info("[regen] %d/%d prompts (%.0f%%), %.1f new tokens/s, %.0fs elapsed, eta %.0fs",
                        total_done, len(prompts), 100.0 * total_done / len(prompts),
                        new_tokens / max(elapsed, 1e-9), elapsed, eta)
    return {"prompts": len(prompts), "skipped": len(done), "written": written, "new_tokens": new_tokens}


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-regen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=Path, help="JSONL of {\"messages\": [...]} or {\"prompt\": ...} (required)")
    p.add_argument("--out", type=Path, help="chat JSONL to write (appended to when resuming; required)")
    cli.add_config_args(p, config_help="job config whose [target] section names the model",
                        set_example="target.device=cuda:0", env=False)
    p.add_argument("--model", help="shortcut for --set target.model=MODEL; with --base-url, the served model's name")
    p.add_argument("--batch-size", type=int, help="prompts per generate call (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="answer length cap (default 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--threads", type=int, help="torch CPU threads (default target.threads, else torch's)")
    p.add_argument("--limit", type=int, default=0, help="answer only the first N prompts of the file (default all)")
    server = p.add_argument_group("answers from an OpenAI-compatible server")
    server.add_argument("--base-url", help="the server's OpenAI API root, e.g. http://host:8000/v1")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token for the server (default: $OPENAI_API_KEY)")
    server.add_argument("--concurrency", type=int, help="requests in flight (default 8)")
    server.add_argument("--max-attempts", type=int, help="tries per prompt before it is skipped (default 6)")
    server.add_argument("--request-timeout-s", type=float, help="limit on one request (default 600)")
    args = p.parse_args(argv)
    if args.print_config and args.base_url:
        p.error("--print-config shows the in-process mode's config; with --base-url the server's settings apply")
    if not args.print_config and (args.prompts is None or args.out is None):
        p.error("--prompts and --out are required")
    if args.base_url:
        return _main_server(p, args)
    if args.concurrency is not None or args.max_attempts is not None or args.request_timeout_s is not None:
        p.error("--concurrency, --max-attempts and --request-timeout-s need --base-url")
    if args.batch_size is None:
        args.batch_size = 8
    if args.batch_size < 1 or args.max_new_tokens < 1 or args.temperature < 0 or args.limit < 0:
        p.error("--batch-size and --max-new-tokens must be >= 1, --temperature and --limit >= 0")

    from common.config import ConfigError, load_config
    from common.logging_setup import setup_logging

    overrides = cli.config_overrides(args, env=False, flags=[cli.override("target.model", args.model)] if args.model else [])
    if args.print_config:
        cfg = cli.load_job_config("dflash-regen", args.config, overrides)
        return 2 if cfg is None else cli.print_config(cfg, "dflash-regen", args.config, overrides)
    setup_logging("regen")
    try:
        cfg = load_config(args.config, overrides)
        prompts = read_prompts(args.prompts)
        if args.limit:
            prompts = prompts[: args.limit]
        resume_state(args.out, prompts)  # refuse a foreign --out before the model loads

        import torch

        from common.devices import resolve_dtype
        from common.model_loader import ModelLoadError, load_target
        from common.packing import dtype_from_name

        threads = args.threads if args.threads is not None else cfg.target.threads
        if threads:
            torch.set_num_threads(threads)
        dtype = dtype_from_name(resolve_dtype(cfg.target.dtype, cfg.target.device))
        try:
            loaded = load_target(cfg.target.model, device=cfg.target.device, dtype=dtype,
                                 tokenizer_source=cfg.target.tokenizer or None)
        except ModelLoadError as exc:
            raise RegenError(str(exc)) from None
        stop_ids = _stop_ids(loaded)
        counts = regenerate(loaded.model, loaded.tokenizer, prompts, args.out, batch_size=args.batch_size,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                            stop_ids=stop_ids, pad_token_id=loaded.pad_token_id)
    except (ConfigError, RegenError) as exc:
        print(f"dflash-regen: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflash-regen: interrupted; finished batches are in {args.out}, rerun the same command to resume",
              file=sys.stderr)
        return 130
    print(f"dflash-regen: {counts['written']} answers written, {counts['skipped']} already there: {args.out}")
    return 0


def _main_server(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``main`` with ``--base-url``: the answers come from an OpenAI-compatible server."""
    if args.config or args.overrides or args.threads is not None or args.batch_size is not None:
        p.error("--config, --set, --threads and --batch-size are for the in-process mode; drop them with --base-url")
    if args.max_new_tokens < 1 or args.temperature < 0 or args.limit < 0:
        p.error("--max-new-tokens must be >= 1, --temperature and --limit >= 0")

    from common.logging_setup import setup_logging
    from tools.regen_client import RetryPolicy, ServerSettings, ServerUnavailable, regenerate_from_server

    given = {"concurrency": args.concurrency, "request_timeout_s": args.request_timeout_s}
    try:
        settings = ServerSettings(
            base_url=args.base_url, model=args.model, api_key=args.api_key or None,
            **{k: v for k, v in given.items() if v is not None},
            **({"retry": RetryPolicy(max_attempts=args.max_attempts)} if args.max_attempts is not None else {}),
        )
    except ValueError as exc:
        p.error(f"--{str(exc).replace('_', '-')}")
    setup_logging("regen")
    try:
        prompts = read_prompts(args.prompts)
        if args.limit:
            prompts = prompts[: args.limit]
        counts = regenerate_from_server(prompts, args.out, settings, max_new_tokens=args.max_new_tokens,
                                        temperature=args.temperature, seed=args.seed)
    except ServerUnavailable as exc:
        print(f"dflash-regen: {exc}; rerun the same command to resume", file=sys.stderr)
        return 1
    except RegenError as exc:
        print(f"dflash-regen: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflash-regen: interrupted; answers received are in {args.out}, rerun the same command to resume",
              file=sys.stderr)
        return 130
    failed = counts["failed"]
    if failed:
        shown = ", ".join(f"line {line} ({why})" for line, why in failed[:5])
        print(f"dflash-regen: {len(failed)} prompts not answered: {shown}{', ...' if len(failed) > 5 else ''}; "
              "a rerun tries them again", file=sys.stderr)
    print(f"dflash-regen: {counts['written']} answers written, {counts['skipped']} already there: {args.out}")
    return 1 if failed and not counts["written"] else 0


def _stop_ids(loaded: Any) -> list[int]:
    ids = set()
    for value in (loaded.tokenizer.eos_token_id, getattr(loaded.model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


if __name__ == "__main__":
    sys.exit(main())
