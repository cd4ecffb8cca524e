-- What Prometheus scrapes (/metrics, monitor/metrics.py): every sample of a scrape, in one statement.
--
-- No figure is defined twice: the gauges are the columns of fleet.lane_overview and
-- fleet.pool_overview (14_dashboards.sql), the counters the sums of the hourly roll-up
-- (13_rollups.sql: fleet.lane_hours, summed per lane in fleet.lane_totals, plus the hours after it
-- computed live by fleet.lane_hours_between). Only what those leave out is
-- counted here, each through an index: tasks in ci, batched and dead, throttles by lane and pool.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- Keeps fleet.lane_totals the sums of fleet.lane_hours, a statement at a time (transition tables):
-- the hours a statement adds are added, those it takes out (the roll-up recomputing its last
-- hours) taken off, but not the hours the roll-up's retention drops (its own rule: older than 400
-- days): they stay counted. A TRUNCATE of lane_hours leaves the totals as they are.
-- Security definer: the roll-up's caller (the monitor, an operator) holds no write grant on it.
create or replace function fleet._lane_totals_follow()
returns trigger
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if tg_op in ('DELETE', 'UPDATE') then
        insert into fleet.lane_totals as t (lane, enqueued, routed_in, started, done, routed, failed, handed_off, lost, cancelled, runs_ended, input_tokens, cache_creation_tokens, cache_read_tokens, output_tokens, cost_usd)
        select o.lane, -sum(o.enqueued), -sum(o.routed_in), -sum(o.started), -sum(o.done), -sum(o.routed), -sum(o.failed), -sum(o.handed_off), -sum(o.lost), -sum(o.cancelled), -sum(o.runs_ended), -sum(o.input_tokens), -sum(o.cache_creation_tokens), -sum(o.cache_read_tokens), -sum(o.output_tokens), -sum(o.cost_usd)
          from old_rows o
         where tg_op = 'UPDATE' or o.hour >= now() - interval '400 days'
         group by o.lane
        on conflict (lane) do update
               set enqueued = t.enqueued + excluded.enqueued,
                   routed_in = t.routed_in + excluded.routed_in,
                   started = t.started + excluded.started,
                   done = t.done + excluded.done,
                   routed = t.routed + excluded.routed,
                   failed = t.failed + excluded.failed,
                   handed_off = t.handed_off + excluded.handed_off,
                   lost = t.lost + excluded.lost,
                   cancelled = t.cancelled + excluded.cancelled,
                   runs_ended = t.runs_ended + excluded.runs_ended,
                   input_tokens = t.input_tokens + excluded.input_tokens,
                   cache_creation_tokens = t.cache_creation_tokens + excluded.cache_creation_tokens,
                   cache_read_tokens = t.cache_read_tokens + excluded.cache_read_tokens,
                   output_tokens = t.output_tokens + excluded.output_tokens,
                   cost_usd = t.cost_usd + excluded.cost_usd,
                   updated_at = now();
    end if;
    if tg_op in ('INSERT', 'UPDATE') then
        insert into fleet.lane_totals as t (lane, enqueued, routed_in, started, done, routed, failed, handed_off, lost, cancelled, runs_ended, input_tokens, cache_creation_tokens, cache_read_tokens, output_tokens, cost_usd)
        select n.lane, sum(n.enqueued), sum(n.routed_in), sum(n.started), sum(n.done), sum(n.routed), sum(n.failed), sum(n.handed_off), sum(n.lost), sum(n.cancelled), sum(n.runs_ended), sum(n.input_tokens), sum(n.cache_creation_tokens), sum(n.cache_read_tokens), sum(n.output_tokens), sum(n.cost_usd)
          from new_rows n
         group by n.lane
        on conflict (lane) do update
               set enqueued = t.enqueued + excluded.enqueued,
                   routed_in = t.routed_in + excluded.routed_in,
                   started = t.started + excluded.started,
                   done = t.done + excluded.done,
                   routed = t.routed + excluded.routed,
                   failed = t.failed + excluded.failed,
                   handed_off = t.handed_off + excluded.handed_off,
                   lost = t.lost + excluded.lost,
                   cancelled = t.cancelled + excluded.cancelled,
                   runs_ended = t.runs_ended + excluded.runs_ended,
                   input_tokens = t.input_tokens + excluded.input_tokens,
                   cache_creation_tokens = t.cache_creation_tokens + excluded.cache_creation_tokens,
                   cache_read_tokens = t.cache_read_tokens + excluded.cache_read_tokens,
                   output_tokens = t.output_tokens + excluded.output_tokens,
                   cost_usd = t.cost_usd + excluded.cost_usd,
                   updated_at = now();
    end if;
    return null;
end
$$;
revoke all on function fleet._lane_totals_follow() from public;
grant execute on function fleet._lane_totals_follow() to service_role;
create or replace trigger lane_totals_insert after insert on fleet.lane_hours
    referencing new table as new_rows for each statement execute function fleet._lane_totals_follow();
create or replace trigger lane_totals_delete after delete on fleet.lane_hours
    referencing old table as old_rows for each statement execute function fleet._lane_totals_follow();
create or replace trigger lane_totals_update after update on fleet.lane_hours
    referencing old table as old_rows new table as new_rows
    for each statement execute function fleet._lane_totals_follow();

-- Every sample, as a JSON array of {metric, lane, pool, label, value}: metric is a name without the
-- lanefleet_ prefix, label the state of `tasks` or the kind of `tokens_total` (NULL where the
-- metric has none). One value, not rows: PostgREST cuts a set of rows at its db-max-rows (1,000
-- here and on Supabase), some 30 lanes' worth. Gauges: what
-- is there now. Counters (`*_total`): since the lane's first hour rolled up, so they only go up;
-- the first roll-up of a database with more than 30 days of history (it rolls up 30 days) is a
-- counter reset, which Prometheus's rate() and increase() take in their stride. Before that first
-- roll-up the whole history is computed live (the monitor's first pass makes it).
-- Security invoker, like the views it reads: a key limited to some lanes gets the samples of its
-- lanes and of the pools they draw from, counted from its lanes' rows alone.
create or replace function fleet.metrics()
returns jsonb
language plpgsql
stable
as $$
begin
    -- (PL/pgSQL, for its plan: the connection keeps it; planning this statement costs more than running it)
    return (
        with total as (
            -- the counters per lane: the hours rolled up (their sums: fleet.lane_totals), and the
            -- hours after them computed live, as fleet.lane_hours_since() does
            select c.lane,
                   sum(c.enqueued) as enqueued, sum(c.routed_in) as routed_in, sum(c.started) as claims,
                   sum(c.done) as completions, sum(c.routed) as routes, sum(c.failed) as failures,
                   sum(c.handed_off) as handoffs, sum(c.lost) as repairs, sum(c.cancelled) as cancellations,
                   sum(c.input_tokens) as input_tokens, sum(c.cache_creation_tokens) as cache_creation_tokens,
                   sum(c.cache_read_tokens) as cache_read_tokens, sum(c.output_tokens) as output_tokens,
                   sum(c.cost_usd) as cost_usd
              from (select lt.lane, lt.enqueued, lt.routed_in, lt.started, lt.done, lt.routed, lt.failed,
                           lt.handed_off, lt.lost, lt.cancelled, lt.input_tokens, lt.cache_creation_tokens,
                           lt.cache_read_tokens, lt.output_tokens, lt.cost_usd
                      from fleet.lane_totals lt
                    union all
                    select h.lane, h.enqueued, h.routed_in, h.started, h.done, h.routed, h.failed,
                           h.handed_off, h.lost, h.cancelled, h.input_tokens, h.cache_creation_tokens,
                           h.cache_read_tokens, h.output_tokens, h.cost_usd
                      from fleet.lane_hours_between(coalesce(fleet.lane_hours_rolled_until(), '-infinity'),
                                                    'infinity') h) c
             group by c.lane
        ), per_lane as (
            select o.lane, x.metric, x.label, x.value
              from fleet.lane_overview o
              left join total h on h.lane = o.lane
             cross join lateral (values
                   ('tasks', 'queued', o.queued::double precision),
                   ('tasks', 'running', o.running),
                   ('tasks', 'blocked', o.blocked),
                   ('tasks', 'review', o.in_review),
                   -- the states lane_overview leaves out (tasks_live_lane, index only)
                   ('tasks', 'ci', (select count(*) from fleet.tasks t where t.lane = o.lane and t.state = 'ci')),
                   ('tasks', 'batched', (select count(*) from fleet.tasks t where t.lane = o.lane and t.state = 'batched')),
                   ('tasks', 'dead', (select count(*) from fleet.tasks t where t.lane = o.lane and t.state = 'dead')),
                   ('tasks_ready', null, o.ready),
                   ('tasks_needing_attention', null, o.needs_attention),
                   ('oldest_ready_seconds', null, coalesce(o.oldest_ready_seconds, 0)),
                   ('lane_slots', null, o.slots),
                   ('lane_idle_slots', null, o.idle_slots),
                   ('lane_paused', null, case when o.paused then 1 else 0 end),
                   ('shifts_active', null, o.active_sessions),
                   ('enqueued_total', null, coalesce(h.enqueued, 0)),
                   ('routed_in_total', null, coalesce(h.routed_in, 0)),
                   ('claims_total', null, coalesce(h.claims, 0)),
                   ('completions_total', null, coalesce(h.completions, 0)),
                   ('routes_total', null, coalesce(h.routes, 0)),
                   ('failures_total', null, coalesce(h.failures, 0)),
                   ('handoffs_total', null, coalesce(h.handoffs, 0)),
                   ('repairs_total', null, coalesce(h.repairs, 0)),
                   ('cancellations_total', null, coalesce(h.cancellations, 0)),
                   ('tokens_total', 'input', coalesce(h.input_tokens, 0)),
                   ('tokens_total', 'cache_creation', coalesce(h.cache_creation_tokens, 0)),
                   ('tokens_total', 'cache_read', coalesce(h.cache_read_tokens, 0)),
                   ('tokens_total', 'output', coalesce(h.output_tokens, 0)),
                   ('cost_usd_total', null, coalesce(h.cost_usd, 0))) x (metric, label, value)
        ), samples as (
            select p.metric, p.lane, null as pool, p.label, p.value from per_lane p where p.value is not null
            union all
            -- usage limits hit, by lane and pool: every throttle writes a throttled event (events_kind_ts)
            select 'throttles_total', e.lane, e.detail ->> 'pool', null, count(*)
              from fleet.events e where e.kind = 'throttled'
             group by e.lane, e.detail ->> 'pool'
            union all
            -- the pools now: fleet.pool_overview
            select x.metric, null, po.pool, null, x.value
              from fleet.pool_overview po
             cross join lateral (values
                   ('pool_slots', po.slots::double precision),
                   ('pool_in_use', po.in_use),
                   ('pool_throttled', case when po.throttled_until is not null then 1 else 0 end),
                   ('pool_throttled_seconds', coalesce(extract(epoch from po.throttled_until - now()), 0))) x (metric, value)
             where x.value is not null
            union all
            -- the pools' usage windows now: fleet.pool_windows (how full, by the provider or the estimate)
            select x.metric, null, pw.pool, pw.window_name, x.value
              from fleet.pool_windows pw
             cross join lateral (values
                   ('pool_window_utilization', pw.utilization::double precision),
                   ('pool_window_reset_seconds', greatest(extract(epoch from pw.resets_at - now()), 0)::double precision)) x (metric, value)
             where x.value is not null
        )
        select coalesce(jsonb_agg(jsonb_build_object('metric', s.metric, 'lane', s.lane, 'pool', s.pool,
                                                     'label', s.label, 'value', s.value)
                                  order by s.metric, s.lane, s.pool, s.label), '[]')
          from samples s
    );
end
$$;
comment on function fleet.metrics() is
    'Every sample of a Prometheus scrape, a JSON array of {metric, lane, pool, label, value}: tasks by '
    'state, ready, oldest ready age, slots, idle slots, paused, shifts (fleet.lane_overview); claims, '
    'completions, failures, repairs, tokens by kind, cost and more as counters since the first hour '
    'rolled up (fleet.lane_totals + the hours computed live); throttles by lane and pool; pool slots, '
    'in use, throttled (fleet.pool_overview). A key limited to some lanes gets its lanes'' samples.';
revoke all on function fleet.metrics() from public;
grant execute on function fleet.metrics() to fleet_operator, service_role;
