"""The cost of a run whose agent CLI reports none (Codex, Gemini CLI): tokens × the model's price.

Prices are USD per million tokens. :data:`DEFAULT_PRICES` are the providers' published list
prices for their API (standard tier, prompts up to 200k tokens) as of late 2025 — check them
against your contract; ``[prices."<model>"]`` in fleet.toml adds or replaces one. A model is
found by its exact name, then by the longest known name it starts with
(``claude-sonnet-4-5-20250929`` → ``claude-sonnet-4-5``), after dropping a provider prefix
(``openai/gpt-5`` → ``gpt-5``). A model without a price costs nothing and the run says so
(``cost_source`` stays empty).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.agent.adapters.base import Reading, Tokens
from worker.config import PriceConfig


def _p(input_: float, output: float, cache_read: float, cache_write: float | None = None) -> PriceConfig:
    return PriceConfig(input=input_, output=output, cache_read=cache_read, cache_write=cache_write)


DEFAULT_PRICES: dict[str, PriceConfig] = {
    # OpenAI (Codex CLI): cached input is a tenth of input; no cache-write charge
    "gpt-5": _p(1.25, 10.0, 0.125),
    "gpt-5-codex": _p(1.25, 10.0, 0.125),
    "gpt-5.1": _p(1.25, 10.0, 0.125),
    "gpt-5.1-codex": _p(1.25, 10.0, 0.125),
    "gpt-5-mini": _p(0.25, 2.0, 0.025),
    "gpt-5.1-codex-mini": _p(0.25, 2.0, 0.025),
    "gpt-5-nano": _p(0.05, 0.40, 0.005),
    "gpt-4.1": _p(2.0, 8.0, 0.50),
    "o3": _p(2.0, 8.0, 0.50),
    "o4-mini": _p(1.10, 4.40, 0.275),
    # Google (Gemini CLI)
    "gemini-2.5-pro": _p(1.25, 10.0, 0.31),
    "gemini-2.5-flash": _p(0.30, 2.50, 0.075),
    "gemini-2.5-flash-lite": _p(0.10, 0.40, 0.025),
    # Anthropic (Claude Code reports its own cost; these serve opencode and gateways that do not)
    "claude-opus-4-1": _p(15.0, 75.0, 1.50, 18.75),
    "claude-opus-4-5": _p(5.0, 25.0, 0.50, 6.25),
    "claude-sonnet-4-5": _p(3.0, 15.0, 0.30, 3.75),
    "claude-sonnet-4": _p(3.0, 15.0, 0.30, 3.75),
    "claude-haiku-4-5": _p(1.0, 5.0, 0.10, 1.25),
}


def price_for(model: str | None, prices: Mapping[str, PriceConfig]) -> PriceConfig | None:
    """The price of ``model``: ``prices`` (the config's) over the defaults."""
    if not model:
        return None
    table = {**DEFAULT_PRICES, **prices}
    name = model.rsplit("/", 1)[-1]
    for candidate in (model, name):
        if candidate in table:
            return table[candidate]
    known = sorted((k for k in table if name.startswith(k)), key=len, reverse=True)
    return table[known[0]] if known else None


def cost(by_model: Mapping[str, Tokens], prices: Mapping[str, PriceConfig]) -> float | None:
    """USD for the tokens of each model, or None when a model that used tokens has no price."""
    total = 0.0
    for model, t in by_model.items():
        p = price_for(model, prices)
        if p is None:
            if t.total:
                return None
            continue
        read = p.cache_read if p.cache_read is not None else p.input
        write = p.cache_write if p.cache_write is not None else p.input
        total += (t.input * p.input + t.output * p.output + t.cache_read * read + t.cache_write * write) / 1e6
    return round(total, 6)


def run_cost(reading: Reading, tokens: Tokens, model: str | None,
             prices: Mapping[str, PriceConfig]) -> tuple[float, str | None]:
    """What a run cost, and whether the CLI reported it (``reported``) or the price table gave it
    (``computed``; None: no price for its model). ``tokens``: the run's own (a session's running
    total less what earlier runs of it counted); ``model``: the dispatched one, for tokens the CLI
    does not attribute to a model."""
    if reading.cost_usd is not None:
        return reading.cost_usd, "reported"
    # the models the CLI named (a router alias such as Gemini's "auto-gemini-3" has no price: then
    # the dispatched model's)
    computed = cost(reading.by_model, prices) if reading.by_model and not reading.session_total else None
    if computed is None:
        computed = cost({model or "": tokens}, prices)
    return (computed, "computed") if computed is not None else (0.0, None)


def spent(reading: Reading, model: str | None, prices: Mapping[str, PriceConfig]) -> tuple[float, int]:
    """What a run has spent by its reading so far, as a budget counts it: (cost, tokens)."""
    return run_cost(reading, reading.tokens, model, prices)[0], reading.tokens.total


def run_report(reading: Reading, tokens: Tokens, model: str | None,
               prices: Mapping[str, PriceConfig]) -> dict[str, Any]:
    """The token, cost, session and model fields of ``fleet.record_run`` for a reading."""
    spent, source = run_cost(reading, tokens, model, prices)
    out: dict[str, Any] = {
        "agent": reading.agent, "input_tokens": tokens.input, "cache_creation_tokens": tokens.cache_write,
        "cache_read_tokens": tokens.cache_read, "output_tokens": tokens.output,
        "reasoning_tokens": tokens.reasoning, "cost_usd": spent, "cost_source": source,
    }
    if reading.session_id:
        out["agent_session"] = reading.session_id
    named = model or ",".join(reading.models)  # what was dispatched, else what the agent said it ran
    if named:
        out["model"] = named
    return out
