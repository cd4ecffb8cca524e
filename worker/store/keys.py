"""Fleet keys (DESIGN §8): HS256 JWTs that a host sends to Supabase's API as ``Authorization: Bearer``.

A key names a database role (``fleet_worker`` or ``fleet_operator``, which PostgREST switches to)
and, in the claim ``fleet_lanes``, the lanes it may work; the SQL API and row level security
enforce both (migrations/*_fleet_roles_rls.sql). Keys are signed with the project's JWT secret,
read from the environment only (SUPABASE_JWT_SECRET or FLEET_JWT_SECRET), never from a flag that
would land in shell history. ``fleet keys inspect`` reads a key without needing the secret, and
checks its signature when the secret is at hand.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from worker.config import LANE_NAME
from worker.errors import ConfigError, InvalidInput

SECRET_ENV = ("SUPABASE_JWT_SECRET", "FLEET_JWT_SECRET")
ROLES = {"worker": "fleet_worker", "operator": "fleet_operator"}
AUDIENCE = "authenticated"  # what Supabase Auth puts in user JWTs; PostgREST checks it if told to
ISSUER = "lanefleet"
MIN_SECRET = 32  # PostgREST refuses a shorter HS256 secret

def jwt_secret(environ: Mapping[str, str] | None = None) -> str:
    """The project's JWT secret from the environment, or a ConfigError saying where to put it."""
    env = os.environ if environ is None else environ
    for name in SECRET_ENV:
        value = env.get(name)
        if value:
            if len(value) < MIN_SECRET:
                raise ConfigError(f"{name} is {len(value)} characters; a JWT secret has at least {MIN_SECRET}")
            return value
    raise ConfigError(
        "no JWT secret: set SUPABASE_JWT_SECRET (or FLEET_JWT_SECRET) in the environment",
        "Supabase dashboard: Project Settings → JWT Keys, the legacy JWT secret; `fleet dev-stack env` for the local stack",
    )


def mint_key(secret: str, role: str, lanes: Sequence[str] | None = None, ttl_seconds: float = 30 * 86400,
             *, subject: str | None = None, now: float | None = None) -> str:
    """An HS256 key for ``role`` (worker | operator, or the role name itself).

    A worker key must name its lanes (``"*"``: every lane); an operator key without lanes works
    every lane, with lanes only those.
    """
    db_role = ROLES.get(role, role)
    if db_role not in ROLES.values():
        raise InvalidInput(f"--role {role!r} is not a key role (worker or operator)")
    wanted = list(dict.fromkeys(lanes or []))  # keep order, drop repeats
    for lane in wanted:
        if lane != "*" and not LANE_NAME.match(lane):
            raise InvalidInput(f"--lane {lane!r} is not a lane name (lowercase letters, digits, - and _)")
    if db_role == "fleet_worker" and not wanted:
        raise InvalidInput("a worker key needs at least one --lane (or --lane '*' for every lane)")
    if ttl_seconds <= 0:
        raise InvalidInput("--ttl must be positive")
    issued = int(time.time() if now is None else now)
    claims: dict[str, Any] = {
        "iss": ISSUER,
        "sub": subject or f"lanefleet:{role if role in ROLES else db_role}:{uuid.uuid4()}",
        "aud": AUDIENCE,
        "role": db_role,
        "iat": issued,
        "exp": issued + int(ttl_seconds),
    }
    if wanted:
        claims["fleet_lanes"] = wanted
    import jwt  # here, not at the top: PyJWT pulls in cryptography, which `fleet shift` never needs

    return jwt.encode(claims, secret, algorithm="HS256")


def describe_key(key: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What a key says (role, lanes, subject, times) and whether it holds, without trusting it.

    ``signature`` is ``valid`` or ``invalid`` when a secret is in the environment, else
    ``not checked``.
    """
    import jwt

    key = key.strip()
    try:
        header = jwt.get_unverified_header(key)
        claims = jwt.decode(key, options={"verify_signature": False})
    except jwt.PyJWTError as exc:
        raise InvalidInput(f"not a JWT: {exc}") from None
    env = os.environ if environ is None else environ
    signature = "not checked"
    if any(env.get(name) for name in SECRET_ENV):
        try:
            jwt.decode(key, jwt_secret(env), algorithms=["HS256"],
                       options={"verify_exp": False, "verify_aud": False})
            signature = "valid"
        except jwt.PyJWTError:
            signature = "invalid"
    exp = claims.get("exp")
    now = time.time()

    def when(v: Any) -> str | None:
        return datetime.fromtimestamp(v, UTC).isoformat() if isinstance(v, int | float) else None

    lanes = claims.get("fleet_lanes")
    return {
        "role": claims.get("role"),
        "lanes": lanes if lanes is not None else ("every lane" if claims.get("role") in
                                                  ("fleet_operator", "service_role") else None),
        "subject": claims.get("sub"),
        "audience": claims.get("aud"),
        "issuer": claims.get("iss"),
        "algorithm": header.get("alg"),
        "issued_at": when(claims.get("iat")),
        "expires_at": when(exp),
        "expired": bool(isinstance(exp, int | float) and exp <= now),
        "seconds_left": int(exp - now) if isinstance(exp, int | float) else None,
        "signature": signature,
    }
