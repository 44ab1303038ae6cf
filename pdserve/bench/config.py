"""``pdserve bench`` options (named as ``vllm bench serve`` names the same concepts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.configs import ConfigError, doc
from pdserve.engine.config import DEFAULT_MODEL


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = doc("http://127.0.0.1:8000", "the server, any OpenAI-compatible one")
    model: str = doc("", "model name to request (default: the server's first model)")
    endpoint: Literal["/v1/completions", "/v1/chat/completions"] = doc(
        "/v1/completions", "API to call (the chat workload always uses /v1/chat/completions)")
    tokenizer: str = doc(DEFAULT_MODEL, "pdserve model spec whose tokenizer makes exact-length prompts")
    dataset_name: Literal["random", "prefix", "chat", "jsonl", "conversational"] = doc("random", "the workload")
    dataset_path: str = doc("", "the jsonl workload's file")
    num_prompts: int = doc(100, "requests to send (with --duration: the most to send)")
    duration: float = doc(0.0, "send requests for this many seconds instead of a count (0: off)")
    warmup_requests: int = doc(0, "requests sent first and left out of the results")
    request_rate: float = doc(float("inf"), "requests per second (inf: all at once, or as fast as "
                                            "--max-concurrency lets)")
    arrival: Literal["poisson", "gamma", "constant"] = doc(
        "poisson", "arrival process at --request-rate (gamma uses --burstiness as its shape)")
    burstiness: float = doc(1.0, "gamma shape: 1 is Poisson, below 1 burstier, above 1 more regular")
    max_concurrency: int = doc(0, "most requests in flight at once (0: no limit); with rate inf, a "
                                  "closed loop of this many clients")
    rates: str = doc("", "sweep: comma-separated request rates, each run in turn (e.g. 1,2,4,8)")
    attainment_target: float = doc(0.9, "sweep: the goodput rate is the highest rate with at least this SLO "
                                        "attainment")
    random_input_len: int = doc(256, "random: mean prompt tokens")
    random_output_len: int = doc(128, "random, prefix, chat: mean output tokens")
    random_range_ratio: float = doc(0.0, "random: lengths uniform in mean * [1 - ratio, 1 + ratio]")
    prefix_num: int = doc(4, "prefix: number of distinct shared prefixes")
    prefix_len: int = doc(512, "prefix: tokens in each shared prefix")
    suffix_len: int = doc(32, "prefix: random tokens after the prefix")
    chat_turns: int = doc(4, "chat: turns per conversation")
    chat_user_words: int = doc(30, "chat: mean words per user turn")
    max_output_len: int = doc(0, "cap on any request's output tokens (0: none)")
    temperature: float = doc(0.0, "sampling temperature of every request")
    ignore_eos: bool = doc(True, "ask the server to ignore EOS so outputs have their requested lengths")
    seed: int = doc(0, "seed of the workload and of the arrival times")
    timeout_s: float = doc(600.0, "give up on a request after this many seconds")
    result_dir: str = doc("bench-results", "where the JSON of every request and the PNG plots go")
    label: str = doc("", "name of this run in file names (default: workload and time)")
    save_text: bool = doc(False, "keep each request's generated text in the JSON")
    progress: bool = doc(True, "show a progress bar")

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> None:
            raise ConfigError(f"--{key.replace('_', '-')}: {why}")

        if not self.base_url.startswith("http://"):
            bad("base_url", f"must start with http://, got {self.base_url!r}")
        if self.num_prompts < 1:
            bad("num_prompts", f"must be at least 1, got {self.num_prompts}")
        if self.request_rate <= 0:
            bad("request_rate", f"must be positive, got {self.request_rate}")
        if self.burstiness <= 0:
            bad("burstiness", f"must be positive, got {self.burstiness}")
        if self.max_concurrency < 0 or self.warmup_requests < 0 or self.duration < 0:
            bad("max_concurrency", "max-concurrency, warmup-requests and duration must not be negative")
        if self.dataset_name == "jsonl" and not self.dataset_path:
            bad("dataset_path", "the jsonl workload needs --dataset-path FILE")
        for name in ("random_input_len", "random_output_len", "prefix_num", "prefix_len", "chat_turns",
                     "chat_user_words"):
            if getattr(self, name) < 1:
                bad(name, f"must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.random_range_ratio < 1:
            bad("random_range_ratio", f"must be in [0, 1), got {self.random_range_ratio}")
        if self.rates:
            try:
                rates = self.rate_list()
            except ValueError:
                bad("rates", f"expected comma-separated numbers, got {self.rates!r}")
            if any(r <= 0 for r in rates):
                bad("rates", "rates must be positive")

    def arrival_kind(self) -> str:
        """The process the arrivals follow: a Poisson rate with a burstiness is a gamma process (vLLM's
        reading of its flags)."""
        return "gamma" if self.arrival == "poisson" and self.burstiness != 1.0 else self.arrival

    def rate_list(self) -> list[float]:
        return [float(x) for x in self.rates.split(",") if x.strip()]
