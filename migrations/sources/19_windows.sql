-- Capacity windows: a pool's usage windows (fleet.toml [pools.NAME.windows]), how full each is —
-- by the provider's last reading where there is one, else estimated from the runs that drew the
-- pool — and the room a claim looks ahead into.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- How full window p_name (its settings w: seconds, budget_tokens, budget_usd, provider_window,
-- models) of pool p_pool is now. The provider's last reading wins while it is of this window (read
-- within it, its reset not passed): its utilization then, plus the runs of the pool started since.
-- Else an estimate: the runs of the pool started in the last `seconds` (a rolling window), whose
-- first run's start plus `seconds` is when it frees. utilization: the larger of tokens/budget_tokens
-- and usd/budget_usd. p_reading false: the estimate alone (what a reading is compared with).
create or replace function fleet._window_use(p_pool text, p_name text, w jsonb, p_reading boolean default true)
returns table (window_start timestamptz, resets_at timestamptz, used_tokens numeric, used_usd numeric,
               utilization numeric, source text, provider_utilization numeric, estimate_off_by numeric,
               read_at timestamptz, status text)
language plpgsql
stable
rows 1  -- (one row: as fleet._pools_of_the_key says why)
as $$
declare
    v_secs double precision := (w ->> 'seconds')::double precision;
    v_bt numeric := nullif((w ->> 'budget_tokens')::numeric, 0);
    v_bu numeric := nullif((w ->> 'budget_usd')::numeric, 0);
    v_models text[] := array(select jsonb_array_elements_text(case when jsonb_typeof(w -> 'models') = 'array'
                                                                    then w -> 'models' else '[]' end));
    r fleet.pool_window_readings;
    v_from timestamptz;
    v_tok numeric;
    v_usd numeric;
    v_first timestamptz;
begin
    select * into r from fleet.pool_window_readings x
     where x.pool = p_pool and x.window_name = coalesce(w ->> 'provider_window', p_name);
    provider_utilization := r.utilization;
    estimate_off_by := r.utilization - r.estimate_utilization;
    read_at := r.read_at;
    status := r.status;
    if p_reading and r.utilization is not null and r.read_at > now() - make_interval(secs => v_secs)
       and (r.resets_at is null or r.resets_at > now()) then
        v_from := r.read_at;
        source := 'provider';
        resets_at := r.resets_at;
        window_start := coalesce(r.resets_at - make_interval(secs => v_secs), r.read_at);
    else
        v_from := now() - make_interval(secs => v_secs);
        source := 'estimate';
        window_start := v_from;
    end if;
    -- the runs of the pool started since (runs_pool_started), of the window's models if it names any
    select coalesce(sum(ru.input_tokens + ru.cache_creation_tokens + ru.cache_read_tokens + ru.output_tokens), 0),
           coalesce(sum(ru.cost_usd), 0), min(ru.started_at)
      into v_tok, v_usd, v_first
      from fleet.runs ru
     where ru.pool = p_pool and ru.started_at >= v_from
       and (cardinality(v_models) = 0 or exists (select 1 from unnest(v_models) m where ru.model like m || '%'));
    if source = 'provider' then
        used_tokens := coalesce(r.utilization * v_bt, 0) + v_tok;
        used_usd := coalesce(r.utilization * v_bu, 0) + v_usd;
        utilization := r.utilization + coalesce(greatest(v_tok / v_bt, v_usd / v_bu), 0);
    else
        used_tokens := v_tok;
        used_usd := v_usd;
        utilization := coalesce(greatest(v_tok / v_bt, v_usd / v_bu), 0);
        resets_at := v_first + make_interval(secs => v_secs);
    end if;
    return next;
end
$$;
revoke all on function fleet._window_use(text,text,jsonb,boolean) from public;
grant execute on function fleet._window_use(text,text,jsonb,boolean) to fleet_operator, service_role;

-- What a task of lane p_lane and tier p_tier is expected to spend (tokens, usd): the median over the
-- lane's last 50 tasks of that tier that ran in the past 7 days (runs_lane_started), each task's runs
-- summed; NULLs without such history.
create or replace function fleet._expected_cost(p_lane text, p_tier text)
returns table (tokens numeric, usd numeric)
language sql
stable
as $$
    select percentile_cont(0.5) within group (order by x.tok)::numeric,
           percentile_cont(0.5) within group (order by x.usd)::numeric
      from (select ru.task_id,
                   sum(ru.input_tokens + ru.cache_creation_tokens + ru.cache_read_tokens + ru.output_tokens) as tok,
                   sum(ru.cost_usd) as usd
              from fleet.runs ru
             where ru.lane = p_lane and ru.started_at > now() - interval '7 days'
               and ru.tier is not distinct from p_tier and ru.ended_at is not null
             group by ru.task_id
             order by max(ru.started_at) desc
             limit 50) x;
$$;
revoke all on function fleet._expected_cost(text,text) from public;
grant execute on function fleet._expected_cost(text,text) to service_role;

-- The room left in each window of a pool for new work: its budget less the reserve (for the work
-- already running, whose use is recorded at its end), less what is used, less what its running
-- tasks are expected to spend (fleet._expected_cost of their lane and tier). {"<window>":
-- {"left_tokens", "left_usd", "resets_at"}}; {} for a pool without windows.
create or replace function fleet._window_room(p_pool text)
returns jsonb
language plpgsql
stable
as $$
declare
    p fleet.pools;
    k text;
    w jsonb;
    u record;
    v_run_tok numeric := 0;
    v_run_usd numeric := 0;
    v_out jsonb := '{}';
begin
    select * into p from fleet.pools where name = p_pool;
    if not found or p.windows = '{}' then
        return '{}';
    end if;
    select coalesce(sum(e.tokens), 0), coalesce(sum(e.usd), 0) into v_run_tok, v_run_usd
      from fleet.tasks t
      join fleet.runs ru on ru.lease_token = t.lease_token and ru.ended_at is null
     cross join lateral fleet._expected_cost(t.lane, t.tier) e
     where t.state = 'running' and t.pool = p_pool;
    for k, w in select * from jsonb_each(p.windows) loop
        select * into u from fleet._window_use(p_pool, k, w);
        v_out := v_out || jsonb_build_object(k, jsonb_build_object(
            'left_tokens', (w ->> 'budget_tokens')::numeric * (1 - p.reserve) - u.used_tokens - v_run_tok,
            'left_usd', (w ->> 'budget_usd')::numeric * (1 - p.reserve) - u.used_usd - v_run_usd,
            'resets_at', u.resets_at));
    end loop;
    return v_out;
end
$$;
revoke all on function fleet._window_room(text) from public;
grant execute on function fleet._window_room(text) to service_role;

-- Whether a task expected to spend (p_tokens, p_usd) fits the room of a pool (fleet._window_room):
-- every window with a budget has that much left (and some left, for a task without history).
create or replace function fleet._window_fits(p_room jsonb, p_tokens numeric, p_usd numeric)
returns boolean
language sql
immutable
as $$
    select not exists (
        select 1 from jsonb_each(coalesce(p_room, '{}')) r(k, v)
         where (v ->> 'left_tokens' is not null
                and ((v ->> 'left_tokens')::numeric <= 0 or (v ->> 'left_tokens')::numeric < coalesce(p_tokens, 0)))
            or (v ->> 'left_usd' is not null
                and ((v ->> 'left_usd')::numeric <= 0 or (v ->> 'left_usd')::numeric < coalesce(p_usd, 0))));
$$;
revoke all on function fleet._window_fits(jsonb,numeric,numeric) from public;
grant execute on function fleet._window_fits(jsonb,numeric,numeric) to service_role;

-- The room after a claim of (p_tokens, p_usd): taken from every window.
create or replace function fleet._window_take(p_room jsonb, p_tokens numeric, p_usd numeric)
returns jsonb
language sql
immutable
as $$
    select coalesce(jsonb_object_agg(r.k, r.v || jsonb_strip_nulls(jsonb_build_object(
               'left_tokens', (r.v ->> 'left_tokens')::numeric - coalesce(p_tokens, 0),
               'left_usd', (r.v ->> 'left_usd')::numeric - coalesce(p_usd, 0)))), '{}')
      from jsonb_each(coalesce(p_room, '{}')) r(k, v);
$$;
revoke all on function fleet._window_take(jsonb,numeric,numeric) from public;
grant execute on function fleet._window_take(jsonb,numeric,numeric) to service_role;

-- When a pool whose windows have no room for (p_tokens, p_usd) has room again: the latest reset of
-- the windows that are short (NULL: no window is short, or none says when).
create or replace function fleet._window_reopens(p_room jsonb, p_tokens numeric, p_usd numeric)
returns timestamptz
language sql
immutable
as $$
    select max((r.v ->> 'resets_at')::timestamptz)
      from jsonb_each(coalesce(p_room, '{}')) r(k, v)
     where not fleet._window_fits(jsonb_build_object(r.k, r.v), p_tokens, p_usd);
$$;
revoke all on function fleet._window_reopens(jsonb,numeric,numeric) from public;
grant execute on function fleet._window_reopens(jsonb,numeric,numeric) to service_role;

-- A run's report carried the provider's readings of its windows ({"provider", "window", "status",
-- "utilization", "resets_at", "window_minutes"}): each becomes the pool's last reading of that
-- window, with what the runs estimated at that moment (how far off the estimate was).
create or replace function fleet._record_windows(r fleet.runs, p_windows jsonb)
returns void
language plpgsql
as $$
declare
    e jsonb;
    p fleet.pools;
    k text;
    w jsonb;
    v_est numeric;
begin
    if r.pool is null or p_windows is null or jsonb_typeof(p_windows) <> 'array' then
        return;
    end if;
    select * into p from fleet.pools where name = r.pool;
    for e in select x from jsonb_array_elements(p_windows) x loop
        continue when jsonb_typeof(e) <> 'object' or jsonb_typeof(e -> 'window') <> 'string';
        -- the configured window this provider window is
        select j.key, j.value into k, w from jsonb_each(coalesce(p.windows, '{}')) j
         where coalesce(j.value ->> 'provider_window', j.key) = e ->> 'window' limit 1;
        v_est := case when w is not null then (select u.utilization from fleet._window_use(r.pool, k, w, false) u) end;
        insert into fleet.pool_window_readings as x (pool, window_name, status, utilization, resets_at, window_minutes,
                                                     read_at, estimate_utilization, run_id)
        values (r.pool, left(e ->> 'window', 100), left(e ->> 'status', 40),
                case when jsonb_typeof(e -> 'utilization') = 'number' then (e ->> 'utilization')::numeric end,
                (e ->> 'resets_at')::timestamptz,
                case when jsonb_typeof(e -> 'window_minutes') = 'number' then (e ->> 'window_minutes')::int end,
                now(), v_est, r.id)
        on conflict (pool, window_name) do update
           set status = excluded.status, utilization = coalesce(excluded.utilization, x.utilization),
               resets_at = coalesce(excluded.resets_at, x.resets_at),
               window_minutes = coalesce(excluded.window_minutes, x.window_minutes),
               read_at = excluded.read_at, estimate_utilization = excluded.estimate_utilization,
               run_id = excluded.run_id;
        k := null;
        w := null;
    end loop;
end
$$;
revoke all on function fleet._record_windows(fleet.runs,jsonb) from public;
grant execute on function fleet._record_windows(fleet.runs,jsonb) to service_role;

-- Every window of every pool the key's lanes draw from: its budget, how much is used and how full,
-- when it resets, whether the figure is the provider's or the estimate's, and how far off the
-- estimate was at the provider's last reading.
-- The windows of the pools the key's lanes draw from (fleet._pools_of_the_key): their settings,
-- which the pools table shows to keys of every lane only.
-- (rows 10, a row per pool, as fleet._pools_of_the_key says why)
create or replace function fleet._pool_windows_of_the_key()
returns table (pool text, windows jsonb, reserve numeric)
language sql
stable
rows 10
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
    select p.name, p.windows, p.reserve
      from fleet.pools p
     where p.windows <> '{}' and p.name in (select k.name from fleet._pools_of_the_key() k);
$$;
revoke all on function fleet._pool_windows_of_the_key() from public;
grant execute on function fleet._pool_windows_of_the_key() to fleet_operator, service_role;

-- (the use is read as the caller: a key limited to some lanes counts its lanes' runs, as
-- fleet.pool_overview counts its lanes' tasks)
create or replace view fleet.pool_windows with (security_invoker = true) as
select p.pool, w.key as window_name,
       (w.value ->> 'seconds')::double precision as seconds,
       (w.value ->> 'budget_tokens')::numeric as budget_tokens,
       (w.value ->> 'budget_usd')::numeric as budget_usd,
       p.reserve,
       u.used_tokens, u.used_usd, round(u.utilization, 4) as utilization, u.resets_at, u.source,
       u.status as provider_status, u.provider_utilization, round(u.estimate_off_by, 4) as estimate_off_by,
       u.read_at as provider_read_at
  from fleet._pool_windows_of_the_key() p
 cross join lateral jsonb_each(p.windows) w
 cross join lateral fleet._window_use(p.pool, w.key, w.value) u;
comment on view fleet.pool_windows is
    'Per pool and usage window (fleet.toml [pools.NAME.windows]): budget, used, utilization, reset, '
    'source (provider reading or estimate from the runs), and how far off the estimate was at the '
    'provider''s last reading.';
revoke all on fleet.pool_windows from service_role;
grant select on fleet.pool_windows to fleet_operator, service_role;
create or replace trigger read_only instead of insert or update or delete on fleet.pool_windows
    for each row execute function fleet._read_only_view();

-- What the windows did in [p_from, p_to), per pool: throttles avoided (a claim passed the pool over,
-- or a task waited, because its windows had no room), throttles hit (usage limits the pool's runs
-- met anyway), spill-overs (claims that drew the pool other than the lane's first choice), and
-- hand-offs at a window's end (agents asked to stop before a window closed). The bake-off's
-- question, "did the pools throttle often enough for the capacity case to hold?", in one query.
-- Invoker: the events and runs of the caller's lanes (events_kind_ts, runs_lane_started).
create or replace function fleet.window_outcomes(p_from timestamptz, p_to timestamptz)
returns table (pool text, throttles_avoided bigint, throttles_hit bigint, spill_overs bigint, window_handoffs bigint)
language sql
stable
as $$
    with e as (
        select e.kind, e.detail
          from fleet.events e
         where e.kind in ('window_deferred', 'throttled', 'handed_off')
           and e.ts >= p_from and e.ts < p_to
        union all
        -- the claims that did not take the lane's first choice (runs_lane_started, lane by lane)
        select 'claimed', r.claim_detail || jsonb_build_object('pool', r.pool)
          from fleet.runs r
         where r.claim_detail is not null and r.started_at >= p_from and r.started_at < p_to
           and r.lane = any (array(select l.name from fleet.lanes l))
    ), per_pool as (
        -- a pool passed over (window_spill lists them) or waited for (window_deferred's pools)
        select p.pool, 'avoided' as what
          from e cross join lateral jsonb_array_elements_text(
                   case when e.kind = 'claimed' and jsonb_typeof(e.detail -> 'window_spill') = 'array'
                        then e.detail -> 'window_spill'
                        when e.kind = 'window_deferred' and jsonb_typeof(e.detail -> 'pools') = 'array'
                        then e.detail -> 'pools' else '[]' end) p(pool)
        union all
        select e.detail ->> 'pool', 'hit' from e where e.kind = 'throttled' and e.detail ? 'pool'
        union all
        select e.detail ->> 'pool', 'spill' from e where e.kind = 'claimed' and (e.detail ->> 'spilled')::boolean
        union all
        select e.detail ->> 'pool', 'handoff' from e
         where e.kind = 'handed_off' and e.detail ->> 'reason' = 'window-closing' and e.detail ? 'pool'
    )
    select pp.pool,
           count(*) filter (where pp.what = 'avoided'),
           count(*) filter (where pp.what = 'hit'),
           count(*) filter (where pp.what = 'spill'),
           count(*) filter (where pp.what = 'handoff')
      from per_pool pp
     group by pp.pool
     order by pp.pool;
$$;
comment on function fleet.window_outcomes(timestamptz, timestamptz) is
    'Per pool in [p_from, p_to): throttles avoided by the windows'' look-ahead, throttles hit, spill-overs, '
    'hand-offs at a window''s end.';
revoke all on function fleet.window_outcomes(timestamptz,timestamptz) from public;
grant execute on function fleet.window_outcomes(timestamptz,timestamptz) to fleet_operator, service_role;
