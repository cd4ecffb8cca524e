-- Cohort figures for a window of queued tasks, whole and split by batched/unbatched.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

create or replace function fleet.cohort_split(p_from timestamptz, p_to timestamptz, p_lane text default null,
                                              p_split boolean default true)
returns table (
    cohort text,
    lane text,
    cohort_from timestamptz,
    cohort_to timestamptz,
    tasks bigint,
    completed bigint,
    dead bigint,
    cancelled bigint,
    open bigint,
    first_claim_at timestamptz,
    last_finish_at timestamptz,
    makespan_seconds numeric,
    wall_p50_seconds numeric,
    wall_p95_seconds numeric,
    runs bigint,
    attempts_per_task numeric,
    failures bigint,
    handoffs bigint,
    repairs bigint,
    input_tokens bigint,
    cache_creation_tokens bigint,
    cache_read_tokens bigint,
    output_tokens bigint,
    total_tokens bigint,
    cache_read_share numeric,
    cost_usd numeric,
    tokens_per_completed numeric,
    cost_per_completed numeric,
    batches bigint,
    batch_members bigint,
    evicted bigint,
    eviction_rate numeric,
    ship_runs bigint,
    ship_runs_per_completed numeric,
    blocks bigint,
    operator_cancels bigint,
    operator_retries bigint,
    operator_resumes bigint,
    interventions bigint,
    ci_tasks bigint,
    ci_executions bigint,
    ci_cycles bigint,
    ci_executions_per_task numeric,
    regressions bigint)
language sql
stable
as $$
    with cohort as (
        -- the tasks queued in [p_from, p_to) (tasks_created), in p_lane if given: the lane they
        -- entered the fleet by (a routed task keeps its first lane in stages[0]). Carriers of
        -- batches are not tasks of a cohort. A task is batched when it was ever a member of a
        -- batch (a member released unrun from a cancelled batch is not).
        select t.id, t.state, t.finished_at,
               case when not p_split then 'all'
                    when exists (select 1 from fleet.batch_members bm where bm.task_id = t.id and bm.state <> 'released')
                    then 'batched' else 'unbatched' end as arm
          from fleet.tasks t
         where t.created_at >= p_from and t.created_at < p_to and t.kind = 'task'
           and (p_lane is null or coalesce(t.stages -> 0 ->> 'lane', t.lane) = p_lane)
           -- a lane the caller's key may not work counts as a lane without tasks (the rows read
           -- are the key's anyway: security invoker, the tables' row policies)
           and (p_lane is null or fleet._lane_allowed(p_lane))
    ), cohort_runs as (
        -- the runs of the cohort, every stage. A recent cohort: the runs started since p_from
        -- (runs_lane_started, lane by lane; a task runs after it is queued) matched to the cohort's
        -- tasks by hash. An
        -- older one: looked up task by task (runs_task), so that its cost follows the cohort and
        -- not the runs of all the months since.
        select c.arm, r.task_id, r.started_at, r.outcome, r.input_tokens, r.cache_creation_tokens,
               r.cache_read_tokens, r.output_tokens, r.cost_usd
          from fleet.runs r
          join cohort c on c.id = r.task_id
         where p_from >= now() - interval '35 days'
           and r.started_at >= p_from and r.lane = any (array(select l.name from fleet.lanes l))
        union all
        select c.arm, r.*
          from cohort c
          cross join lateral (
                select r.task_id, r.started_at, r.outcome, r.input_tokens, r.cache_creation_tokens,
                       r.cache_read_tokens, r.output_tokens, r.cost_usd
                  from fleet.runs r where r.task_id = c.id
                offset 0) r  -- keeps the lookup per task (the planner would scan every run since)
         where p_from < now() - interval '35 days'
    ), per_task as (
        -- each task and its first claim
        select c.arm, c.id, c.state, c.finished_at, f.first_claim_at
          from cohort c
          left join (select task_id, min(started_at) as first_claim_at from cohort_runs group by task_id) f
            on f.task_id = c.id
    ), arms as (
        select 'all' as arm where not p_split
        union all select 'batched' where p_split
        union all select 'unbatched' where p_split
    ), run_totals as (
        select arm,
               count(*) as runs,
               count(*) filter (where outcome = 'failed') as failures,
               count(*) filter (where outcome = 'handed_off') as handoffs,
               count(*) filter (where outcome = 'lost') as repairs,
               coalesce(sum(input_tokens), 0) as input_tokens,
               coalesce(sum(cache_creation_tokens), 0) as cache_creation_tokens,
               coalesce(sum(cache_read_tokens), 0) as cache_read_tokens,
               coalesce(sum(output_tokens), 0) as output_tokens,
               coalesce(sum(cost_usd), 0) as cost_usd
          from cohort_runs
         group by arm
    ), members as (
        -- the cohort's batch memberships, and the batches they were in
        select c.arm, bm.batch_id, bm.task_id, bm.state
          from cohort c
          join fleet.batch_members bm on bm.task_id = c.id and bm.state <> 'released'
    ), batch_totals as (
        select arm, count(distinct batch_id) as batches, count(*) as members,
               count(*) filter (where state = 'evicted') as evicted
          from members
         group by arm
    ), task_events as (
        -- blocks and operator actions on the cohort's tasks (events_kind_ts: rare kinds, from p_from on)
        select c.arm, e.kind
          from fleet.events e
          join cohort c on c.id = e.task_id
         where e.kind in ('cancelled', 'retried', 'resumed', 'blocked') and e.ts >= p_from
    ), batch_events as (
        -- and on the carriers of their batches: a batch that is blocked, resumed or shipped counts
        -- once for the arm (a batch is an arm's unit of shipping and of blocking)
        select mb.arm, e.kind
          from (select distinct arm, batch_id from members) mb
          join fleet.batches b on b.id = mb.batch_id
          join fleet.events e on e.task_id = b.task_id
         where e.kind in ('batch_blocked', 'batch_resumed', 'batch_shipped', 'cancelled') and e.ts >= p_from
    ), event_totals as (
        select arm,
               count(*) filter (where kind = 'cancelled') as cancels,
               count(*) filter (where kind = 'retried') as retries,
               count(*) filter (where kind in ('resumed', 'batch_resumed')) as resumes,
               count(*) filter (where kind in ('blocked', 'batch_blocked')) as blocks,
               count(*) filter (where kind = 'batch_shipped') as ships
          from (select * from task_events union all select * from batch_events) x
         group by arm
    ), ci_totals as (
        -- the tasks a source fed (source_items_task): those with a pull request, its CI executions
        -- (workflow runs) and cycles (head SHAs checked), merges reverted within 7 days
        select c.arm,
               count(*) filter (where i.pr_number is not null) as ci_tasks,
               coalesce(sum((select sum(coalesce((v ->> 'runs')::bigint, 0)) from jsonb_each(i.ci) e(sha, v))), 0)
                   as executions,
               coalesce(sum((select count(*) from jsonb_object_keys(i.ci))), 0) as cycles,
               count(*) filter (where i.reverted_at is not null) as regressions
          from cohort c
          join fleet.source_items i on i.task_id = c.id
         group by c.arm
    ), totals as (
        select arm,
               count(*) as tasks,
               count(*) filter (where p.state = 'done') as completed,
               count(*) filter (where p.state = 'dead') as dead,
               count(*) filter (where p.state = 'cancelled') as cancelled,
               count(*) filter (where p.state not in ('done', 'dead', 'cancelled')) as open,
               min(p.first_claim_at) as first_claim_at,
               max(p.finished_at) filter (where p.state in ('done', 'dead')) as last_finish_at,
               -- both percentiles from one sort
               percentile_cont(array[0.5, 0.95]) within group (
                   order by extract(epoch from p.finished_at - p.first_claim_at)::double precision)
                   filter (where p.state = 'done') as walls
          from per_task p
         group by arm
    )
    select a.arm, p_lane, p_from, p_to,
           coalesce(t.tasks, 0), coalesce(t.completed, 0), coalesce(t.dead, 0), coalesce(t.cancelled, 0),
           coalesce(t.open, 0),
           t.first_claim_at, t.last_finish_at,
           round(extract(epoch from t.last_finish_at - t.first_claim_at), 1),
           round(t.walls[1]::numeric, 1),
           round(t.walls[2]::numeric, 1),
           coalesce(u.runs, 0),
           round(coalesce(u.runs, 0)::numeric / nullif(t.tasks, 0), 2),
           coalesce(u.failures, 0), coalesce(u.handoffs, 0), coalesce(u.repairs, 0),
           coalesce(u.input_tokens, 0)::bigint, coalesce(u.cache_creation_tokens, 0)::bigint,
           coalesce(u.cache_read_tokens, 0)::bigint, coalesce(u.output_tokens, 0)::bigint,
           coalesce(u.input_tokens + u.cache_creation_tokens + u.cache_read_tokens + u.output_tokens, 0)::bigint,
           round(u.cache_read_tokens::numeric
                 / nullif(u.input_tokens + u.cache_creation_tokens + u.cache_read_tokens, 0), 4),
           coalesce(u.cost_usd, 0),
           round((u.input_tokens + u.cache_creation_tokens + u.cache_read_tokens + u.output_tokens)::numeric
                 / nullif(t.completed, 0), 1),
           round(u.cost_usd / nullif(t.completed, 0), 6),
           coalesce(bt.batches, 0), coalesce(bt.members, 0), coalesce(bt.evicted, 0),
           round(bt.evicted::numeric / nullif(bt.members, 0), 4),
           coalesce(o.ships, 0),
           round(coalesce(o.ships, 0)::numeric / nullif(t.completed, 0), 4),
           coalesce(o.blocks, 0),
           coalesce(o.cancels, 0), coalesce(o.retries, 0), coalesce(o.resumes, 0),
           coalesce(o.cancels, 0) + coalesce(o.retries, 0) + coalesce(o.resumes, 0),
           coalesce(ci.ci_tasks, 0), coalesce(ci.executions, 0)::bigint, coalesce(ci.cycles, 0)::bigint,
           round(ci.executions::numeric / nullif(ci.ci_tasks, 0), 2),
           coalesce(ci.regressions, 0)
      from arms a
      left join totals t on t.arm = a.arm
      left join run_totals u on u.arm = a.arm
      left join batch_totals bt on bt.arm = a.arm
      left join event_totals o on o.arm = a.arm
      left join ci_totals ci on ci.arm = a.arm
     order by a.arm;
$$;
comment on function fleet.cohort_split(timestamptz, timestamptz, text, boolean) is
    'The figures of fleet.cohort_metrics for the batched and the unbatched tasks of a cohort apart (one row '
    'each; with p_split false one row, cohort ''all''): the A/B of running small tasks as batches, from SQL. '
    'A task is batched when it was ever a member of a batch (not one released unrun). Besides the cohort '
    'figures: cache_read_share = cache_read / (input + cache_creation + cache_read); batches, batch_members, '
    'evicted and eviction_rate (evicted / members); ship_runs (a batch''s `ship` command, once for the '
    'batched arm; lanefleet runs `ship` for batches only, so a single task''s shipping, inside its agent, '
    'is not counted), ship_runs_per_completed; blocks (a task''s '
    'or its batch''s blocked events); interventions = operator cancels + retries + resumes (`fleet '
    'resume`, of a task or of its batch); for the tasks a source fed: ci_tasks (with a pull request), '
    'ci_executions (workflow runs on it), ci_cycles (head SHAs whose checks were read), '
    'ci_executions_per_task, regressions (merges reverted within 7 days).';
revoke all on function fleet.cohort_split(timestamp with time zone,timestamp with time zone,text,boolean) from public;
grant execute on function fleet.cohort_split(timestamp with time zone,timestamp with time zone,text,boolean) to fleet_operator, service_role;

create or replace function fleet.cohort_metrics(p_from timestamptz, p_to timestamptz, p_lane text default null)
returns table (
    lane text,
    cohort_from timestamptz,
    cohort_to timestamptz,
    tasks bigint,
    completed bigint,
    dead bigint,
    cancelled bigint,
    open bigint,
    first_claim_at timestamptz,
    last_finish_at timestamptz,
    makespan_seconds numeric,
    wall_p50_seconds numeric,
    wall_p95_seconds numeric,
    runs bigint,
    attempts_per_task numeric,
    failures bigint,
    handoffs bigint,
    repairs bigint,
    input_tokens bigint,
    cache_creation_tokens bigint,
    cache_read_tokens bigint,
    output_tokens bigint,
    total_tokens bigint,
    cost_usd numeric,
    tokens_per_completed numeric,
    cost_per_completed numeric,
    operator_cancels bigint,
    operator_retries bigint,
    interventions bigint,
    ci_tasks bigint,
    ci_executions bigint,
    ci_cycles bigint,
    ci_executions_per_task numeric,
    regressions bigint)
language sql
stable
as $$
    select s.lane, s.cohort_from, s.cohort_to, s.tasks, s.completed, s.dead, s.cancelled, s.open,
           s.first_claim_at, s.last_finish_at, s.makespan_seconds, s.wall_p50_seconds, s.wall_p95_seconds,
           s.runs, s.attempts_per_task, s.failures, s.handoffs, s.repairs, s.input_tokens,
           s.cache_creation_tokens, s.cache_read_tokens, s.output_tokens, s.total_tokens, s.cost_usd,
           s.tokens_per_completed, s.cost_per_completed, s.operator_cancels, s.operator_retries,
           s.operator_cancels + s.operator_retries,
           s.ci_tasks, s.ci_executions, s.ci_cycles, s.ci_executions_per_task, s.regressions
      from fleet.cohort_split(p_from, p_to, p_lane, false) s;
$$;
comment on function fleet.cohort_metrics(timestamptz, timestamptz, text) is
    'The figures of a cohort: the tasks queued in [p_from, p_to) (never the carriers of batches), '
    'optionally only those that entered the fleet in lane p_lane, counted over all their stages and runs '
    'up to now. completed/dead/cancelled/open: their states now; makespan: first claim -> last finish '
    '(done or dead); wall-clock: per completed task, first claim -> finish (p50, p95); attempts_per_task: '
    'runs / tasks; failures, handoffs, repairs: runs that ended so; tokens and cost per completed task '
    '(failed attempts included); operator interventions: cancels and manual retries. Compare two cohorts '
    'to judge a change to the fleet; CI per task a source fed (ci_tasks, ci_executions, ci_cycles, '
    'ci_executions_per_task, regressions: merges reverted within 7 days); fleet.cohort_split gives the same figures for batched and unbatched '
    'tasks apart. Cost follows the cohort''s size (tasks_created, runs_lane_started or runs_task).';
revoke all on function fleet.cohort_metrics(timestamp with time zone,timestamp with time zone,text) from public;
grant execute on function fleet.cohort_metrics(timestamp with time zone,timestamp with time zone,text) to fleet_operator, service_role;

-- Triage with a denominator (issue #21): the verdicts of the triage lanes in a window, and how many
-- were wrong.
create or replace function fleet.triage_metrics(p_from timestamptz, p_to timestamptz, p_lane text default null)
returns table (
    triage_lane text,
    verdict_lane text,
    window_from timestamptz,
    window_to timestamptz,
    verdicts bigint,
    misclassified bigint,
    routed_again bigint,
    evicted bigint,
    failed bigint,
    correct bigint,
    cancelled bigint,
    undecided bigint,
    misclassification_rate numeric)
language sql
stable
as $$
    with verdict as (
        -- the verdicts given in [p_from, p_to): routes out of a triage lane, which fleet.route marks
        -- with detail.verdict (events_kind_ts). A verdict counts only for a key that may work both
        -- lanes: what became of it is read in the verdict lane (security invoker, the row policies).
        select e.id, e.task_id, e.lane as triage_lane, e.detail ->> 'verdict' as verdict_lane
          from fleet.events e
         where e.kind = 'routed' and e.ts >= p_from and e.ts < p_to and e.detail ? 'verdict'
           and (p_lane is null or p_lane in (e.lane, e.detail ->> 'verdict'))
           and fleet._lane_allowed(e.lane) and fleet._lane_allowed(e.detail ->> 'verdict')
    ), judged as (
        -- each verdict's first miss: the first thing the task did in the verdict lane, after the
        -- verdict, that says it did not belong there (events_task). A route out of the lane ends the
        -- task's stay there, so nothing after it (in a later stay) comes first.
        select v.triage_lane, v.verdict_lane, t.state,
               case when m.kind in ('handed_off', 'repaired') then 'failed'
                    -- dead there by a way the events above do not name: failed there all the same
                    when m.kind is null and t.state = 'dead' then 'failed'
                    else m.kind end as miss
          from verdict v
          left join lateral (
                select x.kind
                  from fleet.events x
                 where x.task_id = v.task_id and x.id > v.id and x.lane = v.verdict_lane
                   and (x.kind in ('routed', 'evicted', 'failed')
                        -- dead there without a failed attempt: past its hand-off or lost-run cap
                        or (x.kind in ('handed_off', 'repaired') and x.detail ->> 'state' = 'dead'))
                 order by x.id
                 limit 1) m on true
          left join fleet.tasks t on t.id = v.task_id
    )
    select j.triage_lane, j.verdict_lane, p_from, p_to,
           count(*),
           count(j.miss),
           count(*) filter (where j.miss = 'routed'),
           count(*) filter (where j.miss = 'evicted'),
           count(*) filter (where j.miss = 'failed'),
           count(*) filter (where j.miss is null and j.state = 'done'),
           count(*) filter (where j.miss is null and j.state = 'cancelled'),
           count(*) filter (where j.miss is null and j.state is distinct from 'done'
                                  and j.state is distinct from 'cancelled'),
           round(count(j.miss)::numeric
                 / nullif(count(j.miss) + count(*) filter (where j.miss is null and j.state = 'done'), 0), 4)
      from judged j
     group by grouping sets ((j.triage_lane), (j.triage_lane, j.verdict_lane))
     order by j.triage_lane, j.verdict_lane nulls first;
$$;
comment on function fleet.triage_metrics(timestamptz, timestamptz, text) is
    'The verdicts of the triage lanes (lane setting triage: a route out of such a lane says which lane a '
    'task belongs in) given in [p_from, p_to), per triage lane (verdict_lane null: all its verdicts) and per '
    'triage and verdict lane; p_lane: only the verdicts from or to that lane. A verdict is misclassified '
    'when its task later left the verdict lane: routed_again (routed out of it), evicted (from a batch '
    'there), failed (a failed attempt there, or dead there), by the first of these; correct: done there '
    'with none of them; cancelled: cancelled there; undecided: still open there. misclassification_rate = '
    'misclassified / (misclassified + correct), the decided verdicts. A verdict counts for a key that may '
    'work both its lanes.';
revoke all on function fleet.triage_metrics(timestamp with time zone,timestamp with time zone,text) from public;
grant execute on function fleet.triage_metrics(timestamp with time zone,timestamp with time zone,text) to fleet_operator, service_role;
