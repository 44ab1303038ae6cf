"""``pdserve generate`` and ``pdserve chat``: the engine in this process, streaming to the terminal."""

from __future__ import annotations

import argparse
import sys
import time

from pdserve.configs import add_arguments, collect_arguments, from_dict
from pdserve.engine.config import EngineConfig


def _sampling_arguments(parser: argparse.ArgumentParser, temperature: float) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    g.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 picks the most likely token (greedy); higher is more random (default: {temperature})")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens whose "
                   "probability reaches this (default: 1.0, all)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default: 0, all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this fraction of the most likely one (default: 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already seen by this (default: 1.0, off)")
    g.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")


def _sampling_params(args: argparse.Namespace):
    from pdserve.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=args.stop,
    )


def _make_llm(args: argparse.Namespace):
    from pdserve.engine.llm import LLM

    options = collect_arguments(args, EngineConfig)
    config = from_dict(EngineConfig, options)
    started = time.perf_counter()
    llm = LLM(**vars(config))
    if args.verbose:
        print(f"[model {config.model} ready in {time.perf_counter() - started:.1f} s]", file=sys.stderr)
    return llm


def _stream(llm, prompt, params, out=sys.stdout) -> tuple[int, float]:
    started, count = time.perf_counter(), 0
    for delta in llm.stream(prompt, params):
        out.write(delta.new_text)
        out.flush()
        count += len(delta.new_token_ids)
    out.write("\n")
    return count, time.perf_counter() - started


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _sampling_params(args)
    for text in args.prompt:
        use_template = not args.no_chat_template and llm.tokenizer.has_chat_template
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": text}]) if use_template else text
        count, seconds = _stream(llm, prompt, params)
        if args.verbose:
            print(f"[{count} tokens in {seconds:.2f} s, {count / seconds:.1f} tokens/s]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _sampling_params(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("pdserve chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.tokenizer.encode_chat(history)
        tee = _Tee()
        try:
            _stream(llm, prompt, params, out=tee)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
        history.append({"role": "assistant", "content": "".join(tee.parts).rstrip("\n")})


class _Tee:
    """Write to stdout and keep what was written."""

    def __init__(self):
        self.parts: list[str] = []

    def write(self, s: str) -> None:
        self.parts.append(s)
        sys.stdout.write(s)

    def flush(self) -> None:
        sys.stdout.flush()


def add_commands(sub) -> None:
    gen = sub.add_parser("generate", help="answer one or more prompts, streaming to the terminal",
                         description="Run the engine in this process and stream the answer to each prompt.")
    gen.add_argument("--prompt", action="append", required=True, help="the prompt (repeatable)")
    gen.add_argument("--no-chat-template", action="store_true",
                     help="send the prompt as raw text instead of a chat user message")
    gen.add_argument("-v", "--verbose", action="store_true", help="print load time and tokens/s to stderr")
    _sampling_arguments(gen, temperature=0.0)
    add_arguments(gen.add_argument_group("engine"), EngineConfig)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal",
                          description="Chat with the model in this process; answers stream as they come.")
    chat.add_argument("--system", default=None, help="a system prompt (default: the model's own)")
    chat.add_argument("-v", "--verbose", action="store_true", help="print load time to stderr")
    _sampling_arguments(chat, temperature=0.7)
    add_arguments(chat.add_argument_group("engine"), EngineConfig)
    chat.set_defaults(func=cmd_chat)
