"""``fleet keys mint|inspect``: lane-scoped JWTs for hosts that use Supabase's API."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from worker.errors import InvalidInput, UnknownLane

app = typer.Typer(no_args_is_help=True, help="Keys: mint lane-scoped JWTs for hosts that use Supabase's API.")


@app.command("mint")
def mint(
    ctx: typer.Context,
    role: Annotated[str, typer.Option("--role", help="worker (shifts) or operator (enqueue, cancel, retry, monitor, reads)")],
    lanes: Annotated[list[str] | None, typer.Option("--lane", "-l", help="a lane the key may work (repeatable; '*' for every lane)")] = None,
    ttl: Annotated[str, typer.Option("--ttl", help="lifetime: 30d, 12h, 90m, ...")] = "30d",
    subject: Annotated[str | None, typer.Option("--subject", help="the sub claim (default: lanefleet:<role>:<uuid>)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the key and its claims as JSON")] = False,
) -> None:
    """Mint a key from the JWT secret in SUPABASE_JWT_SECRET (or FLEET_JWT_SECRET). Printed once, kept nowhere."""
    from worker.config import flag_duration
    from worker.store.keys import describe_key, jwt_secret, mint_key

    seconds = flag_duration(ttl, "--ttl")
    _check_lanes(ctx, lanes or [])
    key = mint_key(jwt_secret(), role, lanes, seconds, subject=subject)
    if as_json:
        print(json.dumps({"key": key, **describe_key(key)}, indent=2))
        return
    print(key)
    info = describe_key(key)
    print(f"{info['role']} key for {_lanes_said(info['lanes'])}, valid until {info['expires_at']}; "
          "it is not stored anywhere: keep it now", file=sys.stderr)


def _check_lanes(ctx: typer.Context, lanes: list[str]) -> None:
    """Refuse a lane the fleet.toml here does not name: a key for a misspelt lane claims nothing.

    A mint touches no database, so the file is what can tell; with no file (a key minted away from
    any host's config) every name is taken as given.
    """
    from worker.cli.context import config_path
    from worker.config import load_config

    named = [lane for lane in lanes if lane != "*"]
    if not named:
        return
    cfg = load_config(config_path(ctx))
    if cfg.source is None:
        return
    unknown = [lane for lane in named if lane not in cfg.lanes]
    if unknown:
        raise UnknownLane(
            f"--lane {unknown[0]!r} is not a lane of {cfg.source}",
            f"its lanes: {', '.join(sorted(cfg.lanes))}; mint beside the fleet.toml that names the lane, "
            "or give that file with fleet --config FILE")


def _shown(name: str, value: object) -> str:
    """A claim of ``keys inspect`` as its table shows it: lanes as a list, yes or no, - for none."""
    if name == "lanes" and isinstance(value, list):
        return "every lane" if "*" in value else ", ".join(value) or "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "-" if value is None else str(value)


def _lanes_said(lanes: list[str] | str | None) -> str:
    """A key's lanes as a sentence says them: 'every lane', 'lane docs', 'lanes docs, bugfix'."""
    if isinstance(lanes, str):
        return lanes  # (describe_key's "every lane")
    if not lanes:
        return "no lane"
    if "*" in lanes:
        return "every lane"
    return f"lane{'s' if len(lanes) > 1 else ''} {', '.join(lanes)}"


@app.command("inspect")
def inspect(
    key: Annotated[str | None, typer.Argument(help="the key (default: read from stdin)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Show a key's role, lanes, expiry and (with the secret set) signature; exit 1 if expired or invalid."""
    from worker.store.keys import describe_key

    text = key if key is not None else sys.stdin.read()
    if not text.strip():
        raise InvalidInput("no key given (pass it as an argument or on stdin)")
    info = describe_key(text)
    if as_json:
        print(json.dumps(info, indent=2))
    else:
        for name, value in info.items():
            print(f"{name:13} {_shown(name, value)}")
    # exit 1 for a key that would be refused: a script can ask `fleet keys inspect` first
    if info["signature"] == "invalid" or info["expired"]:
        raise typer.Exit(1)
