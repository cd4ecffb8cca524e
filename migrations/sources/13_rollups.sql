-- Hourly roll-ups (fleet.lane_hours) that keep the 30-day views fast.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- Roll up the closed hours: those that ended more than p_lag_seconds ago. Nothing to do (the
-- common case) costs one row read. When an hour has closed, the last two hours rolled up before
-- are computed again, for the writes that land late (a run's tokens recorded after its end, a
-- transaction that began before the hour ended). The first call rolls up 30 days.
-- Under a transaction-scoped advisory lock: a concurrent call returns -1 and writes nothing.
-- Security definer, so a role allowed to call it (the monitor, an operator) needs no write grant
-- on fleet.lane_hours; it rolls up every lane, so a key limited to some lanes is refused (LF008,
-- as fleet.reconcile: the views compute the hours not rolled up live for it). Returns the number
-- of rows written.
create or replace function fleet.roll_up_lane_hours(p_lag_seconds int default 300)
returns int
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_until timestamptz := fleet._utc_hour(now() - make_interval(secs => greatest(coalesce(p_lag_seconds, 300), 0)));
    v_done timestamptz;
    v_from timestamptz;
    v_rows int;
begin
    perform fleet._require_lane(null);  -- the roll-up writes every lane's hours
    if (select rolled_until from fleet.lane_hours_rollup) >= v_until then
        return 0;  -- no hour has closed since the last roll-up: nothing written, nothing locked
    end if;
    if not pg_try_advisory_xact_lock(7366104385829013) then
        return -1;
    end if;
    select rolled_until into v_done from fleet.lane_hours_rollup for update;
    if v_done >= v_until then
        return 0;  -- a concurrent roll-up did it meanwhile
    end if;
    v_from := greatest(coalesce(v_done - interval '2 hours', '-infinity'), fleet._utc_hour(now()) - interval '720 hours');
    delete from fleet.lane_hours where hour >= v_from and hour < v_until;
    insert into fleet.lane_hours select * from fleet.lane_hours_between(v_from, v_until);
    get diagnostics v_rows = row_count;
    insert into fleet.lane_hours_rollup as s (singleton, rolled_until, rolled_at) values (true, v_until, now())
    on conflict (singleton) do update set rolled_until = greatest(s.rolled_until, excluded.rolled_until),
                                          rolled_at = excluded.rolled_at;
    -- keep a year and a month of hours
    delete from fleet.lane_hours where hour < now() - interval '400 days';
    return v_rows;
end
$$;
comment on function fleet.roll_up_lane_hours(int) is
    'Roll the closed hours (ended more than p_lag_seconds ago) up into fleet.lane_hours, recomputing '
    'the last two hours rolled up before; called by the monitor pass and the dashboard commands. '
    'Returns the rows written (-1: another roll-up was running). Every lane: refused (LF008) to a key '
    'limited to some lanes.';
revoke all on function fleet.roll_up_lane_hours(integer) from public;
grant execute on function fleet.roll_up_lane_hours(integer) to fleet_operator, service_role;

-- Where the rolled-up hours end (NULL: nothing rolled up). Stable: the planner reads it when it
-- estimates the live part of a view, so the live part is planned for its real (small) range.
create or replace function fleet.lane_hours_rolled_until()
returns timestamptz
language sql
stable
as $$
    select rolled_until from fleet.lane_hours_rollup;
$$;
revoke all on function fleet.lane_hours_rolled_until() from public;
grant execute on function fleet.lane_hours_rolled_until() to fleet_operator, service_role;

-- The runs that ended at p_since or later. ended_at is in no index (closing a run, and
-- record_run, are HOT updates): a run that lasted at most an hour started at most an hour before
-- its end, and one that lasted longer has long_ended_at (runs_long_ended). Inlined into its
-- callers' plans (one SQL statement): a BitmapOr of the two. The runs by start are read lane by
-- lane (runs_lane_started, one descent per lane: every run's lane is a lane, and lanes are never
-- deleted): an index of started_at alone would cost every claim an entry.
create or replace function fleet._runs_ended_since(p_since timestamptz)
returns setof fleet.runs
language sql
stable
as $$
    select * from fleet.runs r
     where (r.lane = any (array(select l.name from fleet.lanes l))
            and r.started_at >= p_since - interval '1 hour' and r.ended_at >= p_since)
        or r.long_ended_at >= p_since;
$$;
revoke all on function fleet._runs_ended_since(timestamp with time zone) from public;
grant execute on function fleet._runs_ended_since(timestamp with time zone) to fleet_operator, fleet_worker, service_role;

-- The hours from p_from on: rolled up where they are, computed live after that.
create or replace function fleet.lane_hours_since(p_from timestamptz)
returns setof fleet.lane_hours
language sql
stable
as $$
    select h.* from fleet.lane_hours h
     where h.hour >= p_from and h.hour < fleet.lane_hours_rolled_until()
    union all
    select * from fleet.lane_hours_between(greatest(p_from, fleet.lane_hours_rolled_until()), 'infinity');
$$;
comment on function fleet.lane_hours_since(timestamptz) is
    'The lane_hours rows from p_from on: the rolled-up hours from fleet.lane_hours, the later ones '
    'computed live by fleet.lane_hours_between().';
revoke all on function fleet.lane_hours_since(timestamp with time zone) from public;
grant execute on function fleet.lane_hours_since(timestamp with time zone) to fleet_operator, service_role;

-- The figures of every lane and UTC hour in [p_from, p_to) with any activity, computed from the
-- tables: what the roll-up stores and what the views compute live for the hours after it.
-- Security invoker: a key's figures come from the rows it may read (the tables' row policies),
-- and only its lanes' rows come back (a row's lane is not always the lane of the rows it counts:
-- tasks routed in, tasks counted in the lane they entered by).
create or replace function fleet.lane_hours_between(p_from timestamptz, p_to timestamptz)
returns setof fleet.lane_hours
language sql
stable
as $$
    with ran as (
        -- every run that started or ended in the range: those that ended since p_from
        -- (fleet._runs_ended_since), and the open ones that started since then (runs_lane_started,
        -- lane by lane)
        select r.id, r.task_id, r.lane, r.attempt, r.outcome, r.started_at, r.ended_at,
               r.input_tokens, r.cache_creation_tokens, r.cache_read_tokens, r.output_tokens, r.cost_usd
          from fleet._runs_ended_since(p_from) r
        union all
        select r.id, r.task_id, r.lane, r.attempt, r.outcome, r.started_at, r.ended_at,
               0, 0, 0, 0, 0
          from fleet.runs r
         where r.ended_at is null and r.lane = any (array(select l.name from fleet.lanes l))
           and r.started_at >= p_from
    ), facts as (
        -- runs that ended in the range, by outcome, with tokens and the stage wall-clock of the
        -- completed stages (a stage starts at the run with attempt 1: runs_task, few rows)
        select r.lane, fleet._utc_hour(r.ended_at) as hour,
               0::bigint as enqueued, 0::bigint as routed_in, 0::bigint as started,
               count(*) filter (where r.outcome = 'done') as done,
               count(*) filter (where r.outcome = 'routed') as routed,
               count(*) filter (where r.outcome = 'failed') as failed,
               count(*) filter (where r.outcome = 'handed_off') as handed_off,
               count(*) filter (where r.outcome = 'lost') as lost,
               count(*) filter (where r.outcome = 'cancelled') as cancelled,
               percentile_cont(array[0.5, 0.95]) within group (
                   order by extract(epoch from r.ended_at - coalesce(fc.started_at, r.started_at))::double precision)
                   filter (where r.outcome in ('done', 'routed')) as walls,
               count(*) as runs_ended,
               sum(r.input_tokens)::bigint as input_tokens,
               sum(r.cache_creation_tokens)::bigint as cache_creation_tokens,
               sum(r.cache_read_tokens)::bigint as cache_read_tokens,
               sum(r.output_tokens)::bigint as output_tokens,
               sum(r.cost_usd) as cost_usd
          from ran r
          left join lateral (
                select r0.started_at from fleet.runs r0
                 where r.attempt > 1 and r.outcome in ('done', 'routed')
                   and r0.task_id = r.task_id and r0.id < r.id and r0.lane = r.lane and r0.attempt = 1
                 order by r0.id desc limit 1) fc on true
         where r.ended_at < p_to
         group by 1, 2
        union all
        -- claims
        select r.lane, fleet._utc_hour(r.started_at), 0, 0, count(*), 0, 0, 0, 0, 0, 0, null, 0, 0, 0, 0, 0, 0
          from ran r
         where r.started_at >= p_from and r.started_at < p_to
         group by 1, 2
        union all
        -- new tasks, in the lane they entered (tasks_created; a routed task keeps it in stages[0])
        select coalesce(t.stages -> 0 ->> 'lane', t.lane), fleet._utc_hour(t.created_at),
               count(*), 0, 0, 0, 0, 0, 0, 0, 0, null, 0, 0, 0, 0, 0, 0
          from fleet.tasks t
         where t.created_at >= p_from and t.created_at < p_to
         group by 1, 2
        union all
        -- tasks routed in from another lane (events_kind_ts)
        select e.detail ->> 'to', fleet._utc_hour(e.ts), 0, count(*), 0, 0, 0, 0, 0, 0, 0, null, 0, 0, 0, 0, 0, 0
          from fleet.events e
         where e.kind = 'routed' and e.ts >= p_from and e.ts < p_to
         group by 1, 2
    )
    select f.lane, f.hour,
           sum(f.enqueued)::bigint, sum(f.routed_in)::bigint, sum(f.started)::bigint, sum(f.done)::bigint,
           sum(f.routed)::bigint, sum(f.failed)::bigint, sum(f.handed_off)::bigint, sum(f.lost)::bigint,
           sum(f.cancelled)::bigint,
           round(max(f.walls[1])::numeric, 1), round(max(f.walls[2])::numeric, 1),
           sum(f.runs_ended)::bigint, sum(f.input_tokens)::bigint, sum(f.cache_creation_tokens)::bigint,
           sum(f.cache_read_tokens)::bigint, sum(f.output_tokens)::bigint, sum(f.cost_usd)
      from facts f
     -- (the key's lanes: one InitPlan, as in the row policies; NULL is every lane)
     where (select fleet._allowed_lanes()) is null or f.lane = any ((select fleet._allowed_lanes())::text[])
     group by f.lane, f.hour;
$$;
comment on function fleet.lane_hours_between(timestamptz, timestamptz) is
    'Per lane and UTC hour in [p_from, p_to) with any activity: enqueued, routed_in, started, the '
    'outcomes of the runs that ended, stage wall-clock p50/p95 of the stages completed, tokens and '
    'cost of the runs that ended. Computed from the tables (cost follows the range).';
revoke all on function fleet.lane_hours_between(timestamp with time zone,timestamp with time zone) from public;
grant execute on function fleet.lane_hours_between(timestamp with time zone,timestamp with time zone) to fleet_operator, service_role;
