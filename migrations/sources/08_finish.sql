-- How a run ends: done, failed, handed off, routed, blocked, throttled, a transient provider error,
-- a dropped agent session; and its run record.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

create or replace function fleet.complete(p_task bigint, p_token uuid, p_result jsonb default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_state text;
begin
    -- fenced by the update itself: it writes the task only while this token holds its lease (the
    -- update's row lock, and its re-check of the row after waiting for another writer); when it
    -- writes nothing, fleet._fenced says why (unknown task, lease lost). A task holds a lease
    -- token while it runs, and only then (the check running_has_lease), so the token's match says
    -- it is running: no test of its state here, where it let the planner read every running task
    -- through tasks_running_session to find this one instead of reading it by id.
    update fleet.tasks t
       set state = d.state, result = p_result, updated_at = now(),
           finished_at = case when d.state = 'done' then now() end,
           attention = null, attention_at = null, verify_pending = false,
           lease_token = null, lease_expires_at = null, session_id = null
      -- (offset 0: the subquery stays one, so its done state is asked once, not for each use)
      from (select x.id, fleet._done_state(x.lane, x.id) as state
              from fleet.tasks x
             where x.id = p_task and x.lease_token = p_token and fleet._lane_allowed(x.lane)
            offset 0) d
     where t.id = d.id and t.lease_token = p_token
    returning d.state into v_state;
    if v_state is null then
        perform fleet._fenced(p_task, p_token);
        perform fleet._raise('LF001', format('lease lost: this lease no longer holds task %s', p_task));
    end if;
    -- its run's end: the completion's entry in the journal (fleet.journal)
    perform fleet._end_run(p_token, 'done', null, v_state);
    return v_state;
end
$$;
revoke all on function fleet.complete(bigint,uuid,jsonb) from public;
grant execute on function fleet.complete(bigint,uuid,jsonb) to fleet_worker, service_role;

create or replace function fleet.complete_many(p_tasks bigint[], p_tokens uuid[], p_results jsonb[] default null)
returns table (task_id bigint, status text)
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
#variable_conflict use_column
declare
    v_n int := coalesce(cardinality(p_tasks), 0);
    v_dup bigint;
begin
    if p_tasks is null or p_tokens is null then
        perform fleet._raise('LF005', 'complete_many needs p_tasks and p_tokens (arrays of equal length)');
    end if;
    if cardinality(p_tokens) <> v_n or (p_results is not null and cardinality(p_results) <> v_n) then
        perform fleet._raise('LF005',
            format('complete_many: p_tasks has %s elements, p_tokens %s%s: one token (and result) per task',
                   v_n, cardinality(p_tokens),
                   case when p_results is null then '' else format(', p_results %s', cardinality(p_results)) end));
    end if;
    if array_position(p_tasks, null) is not null then
        perform fleet._raise('LF005', format('complete_many: p_tasks[%s] is NULL', array_position(p_tasks, null) - 1));
    end if;
    select u.id into v_dup from unnest(p_tasks) u(id) group by u.id having count(*) > 1 order by u.id limit 1;
    if v_dup is not null then
        perform fleet._raise('LF005', format('complete_many: task %s is named twice', v_dup));
    end if;
    if v_n = 0 then
        return;
    end if;

    -- One statement: lock every named task of the caller's lanes, in id order (another lane's
    -- task is neither locked nor told apart from a missing one: it is reported unknown); what a
    -- completed task of each lane becomes (review or done), once per lane; the tasks whose lease the
    -- given token still holds; their rows and their runs written (the runs as fleet._end_run
    -- closes them: the completions' entries in the journal); a status per element in input order.
    -- (The CTEs are materialized with what they read: each is a few rows per named task, read by
    -- id or by lease token.)
    return query
    with locked as materialized (
        select t.id, t.lane, t.state, t.lease_token
          from fleet.tasks t
         where t.id = any (p_tasks) and fleet._lane_allowed(t.lane)
         order by t.id
           for no key update
    ), lanes as materialized (
        select d.lane, fleet._done_state(d.lane, null) as done from (select distinct k.lane from locked k) d
    ), held as materialized (
        select k.id, i.token, i.result,
               -- (a lane with ci: the tasks a source feeds wait for their pull request's CI)
               case d.done when 'ci' then fleet._done_state(k.lane, k.id) else d.done end as state
          from unnest(p_tasks, p_tokens, coalesce(p_results, array_fill(null::jsonb, array[v_n])))
               as i(task_id, token, result)
          join locked k on k.id = i.task_id
          join lanes d on d.lane = k.lane
         where k.state = 'running' and i.token is not null and k.lease_token = i.token
    ), tasks_done as (
        update fleet.tasks t
           set state = h.state, result = h.result, updated_at = now(),
               finished_at = case when h.state = 'done' then now() end,
               attention = null, attention_at = null, verify_pending = false,
               lease_token = null, lease_expires_at = null, session_id = null
          from held h
         where t.id = h.id
    ), runs_done as (
        update fleet.runs r
           set outcome = 'done', ended_at = now(), end_id = nextval('fleet.events_id_seq'), end_state = h.state
          from held h
         where r.lease_token = h.token and r.ended_at is null
    )
    select i.task_id,
           case when h.id is not null then h.state when k.id is not null then 'lost' else 'unknown' end
      from unnest(p_tasks) with ordinality as i(task_id, ord)
      left join held h on h.id = i.task_id
      left join locked k on k.id = i.task_id
     order by i.ord;
end
$$;
comment on function fleet.complete_many(bigint[], uuid[], jsonb[]) is
    'Complete many running tasks in one transaction, each fenced by its own lease token as '
    'fleet.complete fences it: (task_id, status) per element in input order, status done | review | '
    'lost | unknown (no such task, or one of a lane the caller may not work: the same answer). '
    'Refused with nothing changed: arrays of different lengths, a NULL or repeated task id (LF005).';
revoke all on function fleet.complete_many(bigint[],uuid[],jsonb[]) from public;
grant execute on function fleet.complete_many(bigint[],uuid[],jsonb[]) to fleet_worker, service_role;

-- complete_many's answer as one value (see fleet.enqueue_many_json): a JSON array of {task_id,
-- status} in input order.
create or replace function fleet.complete_many_json(p_tasks bigint[], p_tokens uuid[], p_results jsonb[] default null)
returns jsonb
language sql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
    select coalesce(jsonb_agg(jsonb_build_object('task_id', c.task_id, 'status', c.status) order by c.n), '[]')
      from fleet.complete_many(p_tasks, p_tokens, p_results) with ordinality c(task_id, status, n);
$$;
comment on function fleet.complete_many_json(bigint[], uuid[], jsonb[]) is
    'fleet.complete_many with its answer as one JSON array of {task_id, status}, in input order '
    '(one value: PostgREST''s db-max-rows does not cut it).';
revoke all on function fleet.complete_many_json(bigint[],uuid[],jsonb[]) from public;
grant execute on function fleet.complete_many_json(bigint[],uuid[],jsonb[]) to fleet_worker, service_role;

create or replace function fleet.fail(p_task bigint, p_token uuid, p_error text,
                           p_retryable boolean default true, p_reason text default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    l fleet.lanes;
    v_reason text;
    v_delay numeric;
    v_tiers text[];
    v_at int;
    v_tier text;
begin
    t := fleet._fenced(p_task, p_token);
    select * into l from fleet.lanes where name = t.lane;
    if not coalesce(p_retryable, true) then
        v_reason := 'fatal';
    elsif t.failures + 1 + t.evaporations >= fleet._cap(t) then
        v_reason := 'attempt-cap';
    end if;

    -- one tier up for the next attempt when the lane escalates on this reason; the top tier stays
    v_tier := t.tier;
    if v_reason is null and p_reason is not null
       and p_reason = any (array(select jsonb_array_elements_text(
               case when jsonb_typeof(l.config -> 'escalate_on') = 'array' then l.config -> 'escalate_on'
                    else '["unverified-exit", "verify-failed", "stalled"]' end))) then
        v_tiers := fleet._tiers(l);
        v_at := array_position(v_tiers, fleet._tier_for(l, t.tier));
        if v_at is not null and v_at < cardinality(v_tiers) then
            v_tier := v_tiers[v_at + 1];
        end if;
    end if;

    if v_reason is not null then
        update fleet.tasks
           set state = 'dead', dead_reason = v_reason, failures = failures + 1, last_error = p_error,
               verify_pending = false, finished_at = now(), updated_at = now(),
               lease_token = null, lease_expires_at = null, session_id = null
         where id = p_task;
    else
        v_delay := extract(epoch from fleet._backoff(l, t.failures));
        update fleet.tasks
           set state = 'queued', failures = failures + 1, last_error = p_error, tier = v_tier,
               verify_pending = false,
               run_at = now() + fleet._backoff(l, t.failures), updated_at = now(),
               lease_token = null, lease_expires_at = null, session_id = null
         where id = p_task;
    end if;
    update fleet.runs set reason = p_reason where lease_token = p_token;
    perform fleet._end_run(p_token, 'failed', p_error);
    perform fleet._event('failed', t.lane, p_task, t.session_id,
        jsonb_build_object('attempt', t.attempts, 'error', left(p_error, 1000),
                           'retryable', coalesce(p_retryable, true), 'failure', p_reason,
                           'state', case when v_reason is null then 'queued' else 'dead' end,
                           'reason', v_reason, 'backoff_seconds', v_delay));
    if v_tier is distinct from t.tier then
        perform fleet._event('escalated', t.lane, p_task, t.session_id,
            jsonb_build_object('from', t.tier, 'to', v_tier, 'reason', p_reason, 'attempt', t.attempts));
    end if;
    return case when v_reason is null then 'queued' else 'dead' end;
end
$$;
revoke all on function fleet.fail(bigint,uuid,text,boolean,text) from public;
grant execute on function fleet.fail(bigint,uuid,text,boolean,text) to fleet_worker, service_role;

create or replace function fleet.hand_off(p_task bigint, p_token uuid, p_snapshot jsonb)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    l fleet.lanes;
    v_state text;
begin
    if p_snapshot is not null and jsonb_typeof(p_snapshot) <> 'object' then
        perform fleet._raise('LF005', 'a hand-off snapshot must be a JSON object');
    end if;
    t := fleet._fenced(p_task, p_token);
    select * into l from fleet.lanes where name = t.lane;
    v_state := case when t.handoffs + 1 > l.max_handoffs then 'dead' else 'queued' end;
    update fleet.tasks
       set state = v_state,
           handoffs = handoffs + 1,
           handoff = coalesce(p_snapshot, '{}'),
           agent_session = coalesce(p_snapshot ->> 'agent_session', agent_session),
           -- a session the snapshot names lives on this shift's host, under this run's profile
           agent_session_host = case when p_snapshot ->> 'agent_session' is not null
                                     then (select s.host from fleet.sessions s where s.id = t.session_id)
                                     else agent_session_host end,
           agent_session_profile = case when p_snapshot ->> 'agent_session' is not null then t.run_profile
                                        else agent_session_profile end,
           carry_over = (v_state = 'queued'),
           -- work the agent finished and its verify gate had not judged when the shift stopped:
           -- the next attempt runs the gate only (as fleet.resume of a gate's block does)
           verify_pending = verify_pending or coalesce(p_snapshot -> 'verify_pending' = 'true', false),
           run_at = now(),
           dead_reason = case when v_state = 'dead' then 'handoff-cap' end,
           finished_at = case when v_state = 'dead' then now() end,
           updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    perform fleet._end_run(p_token, 'handed_off');
    perform fleet._event('handed_off', t.lane, p_task, t.session_id,
        jsonb_strip_nulls(jsonb_build_object('attempt', t.attempts, 'handoffs', t.handoffs + 1, 'state', v_state,
                                             'pool', t.pool, 'reason', left(p_snapshot ->> 'reason', 100))));
    return v_state;
end
$$;
revoke all on function fleet.hand_off(bigint,uuid,jsonb) from public;
grant execute on function fleet.hand_off(bigint,uuid,jsonb) to fleet_worker, service_role;

-- This stage is done: the same task goes on in lane p_lane, its counters fresh, its stages kept.
-- Refused (LF007, nothing changed) when p_lane does not accept routes from the task's lane, and
-- when p_lane has another task of the task's key (keys are per lane, fleet._key_holder: the one in
-- it, or one that was in it and moved on); the task keeps its key in the lane it leaves. A route out
-- of a triage lane (its config says triage) is a verdict: the routed event says detail.verdict, the
-- lane the task was judged to belong in (fleet.triage_metrics counts how often that was wrong).
create or replace function fleet.route(p_task bigint, p_token uuid, p_lane text, p_note jsonb default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    target fleet.lanes;
    v_holder bigint;
    v_holder_lane text;
    v_triage boolean;
begin
    perform fleet._require_lane(p_lane);
    target := fleet._lane(p_lane);
    t := fleet._fenced(p_task, p_token);
    if target.name = t.lane then
        perform fleet._raise('LF005', format('task %s is already in lane %L; route to another lane', p_task, p_lane));
    end if;
    if target.accepts_from is not null and not (t.lane = any (target.accepts_from)) then
        perform fleet._raise('LF007', format('lane %L does not accept tasks routed from lane %L', p_lane, t.lane),
            'it accepts routes from: ' || coalesce(array_to_string(target.accepts_from, ', '), 'no lane'));
    end if;
    select h.id, h.lane into v_holder, v_holder_lane
      from fleet.tasks h
     where h.key = t.key and h.id <> t.id
       and (h.lane = p_lane or h.stages @> jsonb_build_array(jsonb_build_object('lane', p_lane)))
     limit 1;
    if v_holder is not null then
        perform fleet._route_key_taken(t, p_lane, v_holder, v_holder_lane);
    end if;
    -- close this stage into the history; the next stage's counters start fresh
    begin
        update fleet.tasks
           set stages = stages || jsonb_build_array(jsonb_build_object(
                   'lane', t.lane, 'attempts', t.attempts, 'failures', t.failures,
                   'evaporations', t.evaporations, 'handoffs', t.handoffs, 'transients', t.transients,
                   'agent_session', t.agent_session, 'checkpoint', t.checkpoint,
                   'note', p_note, 'routed_to', p_lane, 'finished_at', now())),
               lane = p_lane, state = 'queued', run_at = now(), carry_over = false,
               attempts = 0, failures = 0, evaporations = 0, handoffs = 0, transients = 0,
               checkpoint = null, checkpoint_seq = 0, handoff = null,
               agent_session = null, agent_session_host = null, agent_session_profile = null,
               last_error = null, updated_at = now(),
               lease_token = null, lease_expires_at = null, session_id = null
         where id = p_task;
    exception when unique_violation then  -- another call took the key into p_lane meanwhile
        select h.id, h.lane into v_holder, v_holder_lane
          from fleet.tasks h where h.key = t.key and h.lane = p_lane;
        perform fleet._route_key_taken(t, p_lane, v_holder, v_holder_lane);
    end;
    perform fleet._end_run(p_token, 'routed');
    select coalesce((l.config ->> 'triage')::boolean, false) into v_triage from fleet.lanes l where l.name = t.lane;
    perform fleet._event('routed', t.lane, p_task, t.session_id,
        jsonb_build_object('from', t.lane, 'to', p_lane, 'note', p_note)
        || case when v_triage then jsonb_build_object('verdict', p_lane) else '{}' end);
    return 'queued';
end
$$;
revoke all on function fleet.route(bigint,uuid,text,jsonb) from public;
grant execute on function fleet.route(bigint,uuid,text,jsonb) to fleet_worker, service_role;

-- LF007: lane p_lane has another task (p_holder, now in lane p_holder_lane) of task t's key. Its id
-- is named only to a caller that may work the lane it is in now.
create or replace function fleet._route_key_taken(t fleet.tasks, p_lane text, p_holder bigint, p_holder_lane text)
returns void
language plpgsql
as $$
begin
    perform fleet._raise('LF007',
        format('lane %L already has a task of key %L%s: task %s cannot be routed there', p_lane, left(t.key, 100),
               case when p_holder is not null and fleet._lane_allowed(p_holder_lane)
                    then format(' (task %s)', p_holder) else '' end, t.id),
        'a key names one task in each lane (and a routed task keeps its key in the lanes it left): '
        'finish this task here, or route it to another lane');
end
$$;
revoke all on function fleet._route_key_taken(fleet.tasks,text,bigint,text) from public;
grant execute on function fleet._route_key_taken(fleet.tasks,text,bigint,text) to service_role;

create or replace function fleet.block(p_task bigint, p_token uuid, p_reason text, p_evidence text default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
begin
    if p_reason is null or p_reason !~ '^[a-z][a-z0-9-]{0,62}$' then
        perform fleet._raise('LF005', format('%L is not a block reason', p_reason),
            'e.g. automation-broken, capability-unavailable, budget');
    end if;
    t := fleet._fenced(p_task, p_token);
    update fleet.tasks
       set state = 'blocked', block_reason = p_reason, last_error = coalesce(p_evidence, last_error),
           verify_pending = false, updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    update fleet.runs set reason = p_reason where lease_token = p_token;
    perform fleet._end_run(p_token, 'blocked', p_evidence);
    perform fleet._event('blocked', t.lane, p_task, t.session_id,
        jsonb_build_object('attempt', t.attempts, 'reason', p_reason, 'evidence', right(p_evidence, 1000)));
    return 'blocked';
end
$$;
revoke all on function fleet.block(bigint,uuid,text,text) from public;
grant execute on function fleet.block(bigint,uuid,text,text) to fleet_worker, service_role;

-- The run hit its pool's usage or rate limit. The pool takes no claims until the reset: p_until
-- (a time the message named), else now() + p_after_seconds (a delay it named, or the profile's
-- backoff), else 15 minutes from now; never sooner than now() + the floor (the task's run
-- profile's throttle_floor_seconds, else 60 s), so a reset read in the past or a zero delay cannot
-- make a hot loop; and never later than now() + fleet._longest_throttle() (8 days), whichever
-- argument said so, so that no worker can stop a pool every lane draws from for longer than a
-- provider's longest window (an operator lifts a throttle sooner: fleet.clear_throttle). The pool
-- keeps the latest reset it was given, and who gave it (throttled_by: the task, its lane,
-- session and host, the caller's role and key). The task goes back to the queue, first of its
-- priority once the reset has come, with its agent session kept, and no failure counted.
-- p_signal: what matched ({"signal", "text", "reset": the reset as read}), kept in the event.
-- Returns the reset.
create or replace function fleet.throttle(p_task bigint, p_token uuid, p_until timestamptz default null,
                                          p_note text default null, p_after_seconds double precision default null,
                                          p_signal jsonb default null)
returns timestamptz
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    v_floor double precision;
    v_longest interval := fleet._longest_throttle();
    v_asked timestamptz;
    v_capped boolean;
    v_until timestamptz;
    v_by jsonb;
    v_pool_until timestamptz;
begin
    -- (a NaN compares greater than every number: it is not a delay)
    if p_after_seconds is not null and (p_after_seconds < 0 or p_after_seconds = 'NaN'::double precision) then
        perform fleet._raise('LF005', format('a throttle delay must be 0 seconds or more, not %s s', p_after_seconds),
            format('a delay past %s is cut to it', v_longest));
    end if;
    if p_signal is not null and jsonb_typeof(p_signal) <> 'object' then
        perform fleet._raise('LF005', format('a throttle signal must be a JSON object, not %s', left(p_signal::text, 200)),
            '{"signal": ..., "text": ..., "reset": ...}');
    end if;
    t := fleet._fenced(p_task, p_token);
    v_floor := coalesce((select pf.throttle_floor_seconds from fleet.profiles pf where pf.name = t.run_profile), 60);
    -- (a delay is cut before it is added: a huge one would overflow the calendar)
    v_asked := coalesce(p_until,
                        case when p_after_seconds is not null then now() + make_interval(
                            secs => least(p_after_seconds, extract(epoch from v_longest)::double precision)) end,
                        now() + interval '15 minutes');
    v_capped := coalesce(p_until > now() + v_longest,
                         p_after_seconds > extract(epoch from v_longest)::double precision, false)
                or v_floor > extract(epoch from v_longest)::double precision;
    v_until := least(greatest(v_asked, now() + make_interval(secs => v_floor)), now() + v_longest);
    v_by := jsonb_strip_nulls(jsonb_build_object(
                'task', p_task, 'lane', t.lane, 'session', t.session_id,
                'host', (select s.host from fleet.sessions s where s.id = t.session_id),
                'profile', t.run_profile, 'at', now()))
            || fleet._caller();
    if t.pool is not null then
        -- the pool waits for the latest reset any of its runs was given (lock order: the task,
        -- then its pool); the note and who set it follow that reset
        update fleet.pools
           set throttled_until = v_until, throttle_note = left(p_note, 1000), throttled_by = v_by,
               updated_at = now()
         where name = t.pool and (throttled_until is null or throttled_until <= v_until);
        select throttled_until into v_pool_until from fleet.pools where name = t.pool;
    end if;
    update fleet.tasks
       set state = 'queued', run_at = v_until, carry_over = true, updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    perform fleet._end_run(p_token, 'throttled', p_note, null, 'usage-limit');
    perform fleet._event('throttled', t.lane, p_task, t.session_id,
        jsonb_strip_nulls(jsonb_build_object('attempt', t.attempts, 'pool', t.pool, 'profile', t.run_profile,
                                             'until', v_until, 'note', left(p_note, 1000),
                                             'signal', p_signal ->> 'signal',
                                             'text', left(p_signal ->> 'text', 1000),
                                             'reset_read', p_signal ->> 'reset',
                                             'pool_until', v_pool_until,
                                             'host', v_by ->> 'host',
                                             -- a reset past the longest window: cut to it
                                             'capped', case when v_capped then true end,
                                             'asked_until', case when v_capped then p_until end,
                                             'asked_after_seconds', case when v_capped then p_after_seconds end))
        || jsonb_build_object('by', fleet._caller()));
    return v_until;
end
$$;
revoke all on function fleet.throttle(bigint,uuid,timestamp with time zone,text,double precision,jsonb) from public;
grant execute on function fleet.throttle(bigint,uuid,timestamp with time zone,text,double precision,jsonb) to fleet_worker, service_role;

-- A provider-side error (overloaded, a 5xx, a connection reset) that says nothing about the work.
-- The task goes back to the queue with its agent session kept and no failure counted, after
-- p_after_seconds (a delay the provider named, 0 to 86400) or the lane's backoff
-- (backoff_base_seconds * 2^transients, at most backoff_max_seconds, at least 5 s); transients
-- counts these. The one past the lane's max_transient (config, default 10) counts as a failure:
-- fleet.fail with reason transient, whose backoff and attempt cap apply, and its answer is
-- returned. Returns queued, or what fleet.fail returns (queued | dead).
create or replace function fleet.transient(p_task bigint, p_token uuid, p_error text,
                                           p_after_seconds double precision default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    l fleet.lanes;
    v_max int;
    v_delay double precision;
    v_until timestamptz;
begin
    -- not (… and …): a NaN compares greater than every number, so it fails the upper bound
    if p_after_seconds is not null and not (p_after_seconds >= 0 and p_after_seconds <= 86400) then
        perform fleet._raise('LF005',
            format('a transient retry delay must be 0 to 86400 s, not %s s', p_after_seconds));
    end if;
    t := fleet._fenced(p_task, p_token);
    select * into l from fleet.lanes where name = t.lane;
    v_max := case when jsonb_typeof(l.config -> 'max_transient') = 'number'
                  then (l.config ->> 'max_transient')::numeric::int else 10 end;
    if t.transients + 1 > v_max then
        return fleet.fail(p_task, p_token, p_error, true, 'transient');
    end if;
    v_delay := coalesce(p_after_seconds,
                        greatest(5, least(l.backoff_max_seconds::double precision,
                                          l.backoff_base_seconds * power(2::double precision, least(t.transients, 30)))));
    v_until := now() + make_interval(secs => v_delay);
    update fleet.tasks
       set state = 'queued', transients = transients + 1, run_at = v_until, carry_over = true,
           updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    update fleet.runs set reason = 'transient' where lease_token = p_token;
    perform fleet._end_run(p_token, 'transient', p_error);
    perform fleet._event('transient', t.lane, p_task, t.session_id,
        jsonb_build_object('attempt', t.attempts, 'error', left(p_error, 1000), 'transients', t.transients + 1,
                           'max_transient', v_max, 'retry_at', v_until, 'pool', t.pool));
    return 'queued';
end
$$;
revoke all on function fleet.transient(bigint,uuid,text,double precision) from public;
grant execute on function fleet.transient(bigint,uuid,text,double precision) to fleet_worker, service_role;

-- The agent answered that the session it was told to resume does not exist. The task forgets its
-- agent session (and where it lived) and goes back to the queue at once, carried over, with no
-- failure counted and no attempt spent but the claim's. Refused (LF005, nothing changed) when the
-- task has no agent session: a fresh start cannot drop one, so this never loops.
create or replace function fleet.drop_session(p_task bigint, p_token uuid, p_note text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
begin
    t := fleet._fenced(p_task, p_token);
    if t.agent_session is null then
        perform fleet._raise('LF005', format('task %s has no agent session: nothing to drop', p_task),
            'a run without an agent session to resume is an ordinary failure (fleet.fail)');
    end if;
    update fleet.tasks
       set state = 'queued', run_at = now(), carry_over = true,
           agent_session = null, agent_session_host = null, agent_session_profile = null,
           updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    perform fleet._end_run(p_token, 'session_dropped', p_note);
    perform fleet._event('session_dropped', t.lane, p_task, t.session_id,
        jsonb_build_object('attempt', t.attempts, 'agent_session', t.agent_session, 'note', left(p_note, 1000)));
    return 'queued';
end
$$;
revoke all on function fleet.drop_session(bigint,uuid,text) from public;
grant execute on function fleet.drop_session(bigint,uuid,text) to fleet_worker, service_role;

-- The task's agent program could not be started on this host ("command not found": exit 127, a
-- spawn failure): no attempt on the work was made, so none is spent. The task goes back to the
-- queue at once (no failure, no hand-off counted; the claim stays counted in attempts), its run
-- ends not_started, and its lane is paused with the reason (fleet.pause_lane), so that no other task
-- of it is claimed into the same mistake until a sync of a fixed config clears the pause.
create or replace function fleet.cannot_start(p_task bigint, p_token uuid, p_error text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    v_error text := left(coalesce(nullif(btrim(p_error), ''), 'the agent program could not be started'), 2000);
begin
    t := fleet._fenced(p_task, p_token);
    update fleet.tasks
       set state = 'queued', run_at = now(), last_error = v_error, updated_at = now(),
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    perform fleet._end_run(p_token, 'not_started', v_error);
    perform fleet._event('not_started', t.lane, p_task, t.session_id,
        jsonb_build_object('attempt', t.attempts, 'error', v_error));
    perform fleet._set_paused_reason(t.lane, v_error, 'run', jsonb_build_object('task', p_task));
    return 'queued';
end
$$;
revoke all on function fleet.cannot_start(bigint,uuid,text) from public;
grant execute on function fleet.cannot_start(bigint,uuid,text) to fleet_worker, service_role;

create or replace function fleet.record_run(p_token uuid, p_report jsonb)
returns void
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    r fleet.runs;
    v_task bigint;
    v_lane text;
begin
    if p_report is null or jsonb_typeof(p_report) <> 'object' then
        perform fleet._raise('LF005', 'a run report must be a JSON object');
    end if;
    -- the run's lane (the task may have been routed on since). A token of a lane the caller may
    -- not work is answered as a token no run holds: a key learns nothing of other lanes' runs
    select task_id, lane into v_task, v_lane from fleet.runs where lease_token = p_token;
    if not found or not fleet._lane_allowed(v_lane) then
        if fleet._allowed_lanes() is null then
            perform fleet._raise('LF003', 'no run holds that lease token');
        end if;
        perform fleet._raise('LF008',
            'no run of this key''s lanes holds that lease token (an unknown token, or a lane not allowed for this key)',
            'the key''s fleet_lanes claim lists the lanes it may work; mint one with `fleet keys mint --lane`');
    end if;
    -- Lock order: the task, then its run, as every transition does (_fenced, cancel, _release lock
    -- the task and then end its run). Taking the run row first deadlocks against them.
    perform 1 from fleet.tasks where id = v_task for no key update;
    begin
        update fleet.runs
           set exit_code = coalesce((p_report ->> 'exit_code')::int, exit_code),
               tier = coalesce(p_report ->> 'tier', tier),
               model = coalesce(p_report ->> 'model', model),
               agent = coalesce(p_report ->> 'agent', agent),
               gate = coalesce(p_report ->> 'gate', gate),
               agent_session = coalesce(p_report ->> 'agent_session', agent_session),
               input_tokens = coalesce((p_report ->> 'input_tokens')::bigint, input_tokens),
               cache_creation_tokens = coalesce((p_report ->> 'cache_creation_tokens')::bigint, cache_creation_tokens),
               cache_read_tokens = coalesce((p_report ->> 'cache_read_tokens')::bigint, cache_read_tokens),
               output_tokens = coalesce((p_report ->> 'output_tokens')::bigint, output_tokens),
               reasoning_tokens = coalesce((p_report ->> 'reasoning_tokens')::bigint, reasoning_tokens),
               cost_usd = coalesce((p_report ->> 'cost_usd')::numeric, cost_usd),
               cost_source = coalesce(p_report ->> 'cost_source', cost_source),
               log_path = coalesce(p_report ->> 'log_path', log_path),
               error_tail = coalesce(left(p_report ->> 'error_tail', 4000), error_tail)
         where lease_token = p_token
        returning * into r;
        -- what the provider said of the pool's usage windows (the last reading of each wins)
        perform fleet._record_windows(r, p_report -> 'windows');
    exception when data_exception or check_violation then
        -- a count that is negative, fractional, not a number or too large; an unknown cost_source
        perform fleet._raise('LF005', format('a run report has a malformed value: %s', sqlerrm),
            'token counts are non-negative integers, cost_usd a non-negative number, exit_code an integer, '
            'cost_source reported or computed');
    end;
    -- the agent's own session id, for the next attempt to resume, and where it lives (the host of
    -- the run's shift, the run's profile: it can be resumed only there), unless a later run took
    -- over or the task was routed on since (the next lane's stage starts without an agent session;
    -- the run row keeps it)
    if p_report ? 'agent_session' then
        update fleet.tasks t
           set agent_session = p_report ->> 'agent_session',
               agent_session_host = case when p_report ->> 'agent_session' is not null
                                         then (select s.host from fleet.sessions s where s.id = r.session_id) end,
               agent_session_profile = case when p_report ->> 'agent_session' is not null then r.profile end
         where t.id = r.task_id
           and t.lane = r.lane
           and not exists (select 1 from fleet.runs later where later.task_id = r.task_id and later.id > r.id);
    end if;
end
$$;
revoke all on function fleet.record_run(uuid,jsonb) from public;
grant execute on function fleet.record_run(uuid,jsonb) to fleet_worker, service_role;

-- Close the run row of a lease: its outcome, and its position in the journal (end_id; a completed
-- run's end is the completion's entry there, with the state its task went to: p_state). One
-- update changing no indexed column: HOT where the page has room.
create or replace function fleet._end_run(p_token uuid, p_outcome text, p_error text default null,
                                          p_state text default null, p_reason text default null)
returns void
language plpgsql
as $$
begin
    update fleet.runs
       set outcome = p_outcome,
           ended_at = now(),
           end_id = nextval('fleet.events_id_seq'),
           end_state = p_state,
           reason = coalesce(p_reason, reason),
           error_tail = coalesce(error_tail, left(p_error, 4000))
     where lease_token = p_token and ended_at is null;
end
$$;
revoke all on function fleet._end_run(uuid,text,text,text,text) from public;
grant execute on function fleet._end_run(uuid,text,text,text,text) to service_role;

-- What a completed task of the lane becomes: ci when the lane has ci = true and a source feeds
-- the task (p_task; NULL: any task of the lane), where it waits for its pull request's checks
-- (fleet.source_ci); else review when the lane requires one, else done.
create or replace function fleet._done_state(p_lane text, p_task bigint)
returns text
language plpgsql
stable
as $$
declare
    l fleet.lanes;
begin
    select * into l from fleet.lanes where name = p_lane;
    if coalesce((l.config ->> 'ci')::boolean, false)
       and (p_task is null or exists (select 1 from fleet.source_items i where i.task_id = p_task)) then
        return 'ci';
    end if;
    return case when coalesce((l.config ->> 'review')::boolean, false) then 'review' else 'done' end;
end
$$;
revoke all on function fleet._done_state(text,bigint) from public;
grant execute on function fleet._done_state(text,bigint) to service_role;

-- What a verify gate's outcome does to the work it judged: the one mapping, for a task
-- (fleet.gate_verdict), a batch member (fleet.batch_member_gate) and a batch's own gate
-- (fleet.batch_tail). ok → the work lands; task-failed → the work is wrong (a failed attempt, an
-- evicted member); automation-broken or capability-unavailable → the gate could not judge, and a
-- person must look (blocked).
create or replace function fleet._gate_transition(p_gate text)
returns text
language plpgsql
immutable
as $$
begin
    case p_gate
        when 'ok' then return 'done';
        when 'task-failed' then return 'failed';
        when 'automation-broken', 'capability-unavailable' then return 'blocked';
        else perform fleet._raise('LF005', format('%L is not a gate outcome', p_gate),
                 'ok, task-failed, automation-broken or capability-unavailable');
    end case;
    return null;
end
$$;
revoke all on function fleet._gate_transition(text) from public;
grant execute on function fleet._gate_transition(text) to service_role;

-- A task's verify gate has judged its agent's work (p_result: what complete records, when it
-- passed). Returns the task's state: done (or review), queued or dead (a failed attempt, reason
-- verify-failed, which escalates like any failure), blocked (the gate's outcome is the reason).
create or replace function fleet.gate_verdict(p_task bigint, p_token uuid, p_gate text, p_evidence text default null,
                                              p_result jsonb default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
begin
    case fleet._gate_transition(p_gate)
        when 'done' then
            perform fleet.complete(p_task, p_token, coalesce(p_result, '{}') || jsonb_build_object('gate', 'ok'));
            return (select state from fleet.tasks where id = p_task);
        when 'failed' then
            return fleet.fail(p_task, p_token, 'verify gate failed: ' || coalesce(right(p_evidence, 1800), ''),
                              true, 'verify-failed');
        else
            return fleet.block(p_task, p_token, p_gate, right(p_evidence, 4000));
    end case;
end
$$;
revoke all on function fleet.gate_verdict(bigint,uuid,text,text,jsonb) from public;
grant execute on function fleet.gate_verdict(bigint,uuid,text,text,jsonb) to fleet_worker, service_role;

