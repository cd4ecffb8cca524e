-- Operator calls: cancel, retry, resume, reviews, budgets, lifting a pool's throttle.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- A task ends as cancelled, whatever held it: a running task's run ends 'cancelled' (its shift's
-- next heartbeat says so and stops the agent), its slot is free at once. The journal's p_kind
-- (cancelled, external_advance) carries p_detail and what the task was. The one cancellation of
-- fleet.cancel (the operator's) and a source's external advance (its issue closed).
create or replace function fleet._cancel(t fleet.tasks, p_kind text, p_detail jsonb default '{}')
returns text
language plpgsql
as $$
begin
    update fleet.tasks
       set state = 'cancelled', finished_at = now(), updated_at = now(), carry_over = false,
           block_reason = null, verify_pending = false,
           lease_token = null, lease_expires_at = null, session_id = null
     where id = t.id;
    if t.state = 'running' then
        perform fleet._end_run(t.lease_token, 'cancelled');
    end if;
    perform fleet._event(p_kind, t.lane, t.id, t.session_id, jsonb_build_object('was', t.state) || p_detail);
    return 'cancelled';
end
$$;
revoke all on function fleet._cancel(fleet.tasks,text,jsonb) from public;
grant execute on function fleet._cancel(fleet.tasks,text,jsonb) to service_role;

create or replace function fleet.cancel(p_task bigint)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
begin
    t := fleet._lock_task(p_task);
    if t.state = 'cancelled' then
        return 'cancelled';
    end if;
    if t.state not in ('queued', 'running', 'blocked', 'ci') then
        perform fleet._raise('LF004',
            format('task %s is %s: only queued, running, blocked or ci tasks can be cancelled', p_task, t.state));
    end if;
    return fleet._cancel(t, 'cancelled');
end
$$;
revoke all on function fleet.cancel(bigint) from public;
grant execute on function fleet.cancel(bigint) to fleet_operator, service_role;

-- A finished, cancelled or blocked task queued again with a fresh cap (its history kept: stages,
-- runs, journal): the operator's retry, and a source's item reopened. LF009 for a retired lane.
create or replace function fleet._requeue(t fleet.tasks, p_kind text, p_detail jsonb default '{}')
returns text
language plpgsql
as $$
begin
    perform fleet._lane(t.lane);  -- LF009: a retired lane takes no task back
    update fleet.tasks
       set state = 'queued', run_at = now(), failures = 0, evaporations = 0, handoffs = 0, transients = 0,
           dead_reason = null, block_reason = null, verify_pending = false,
           finished_at = null, carry_over = false, updated_at = now()
     where id = t.id;
    perform fleet._event(p_kind, t.lane, t.id, null,
        jsonb_build_object('was', t.state, 'reason', coalesce(t.dead_reason, t.block_reason)) || p_detail);
    return 'queued';
end
$$;
revoke all on function fleet._requeue(fleet.tasks,text,jsonb) from public;
grant execute on function fleet._requeue(fleet.tasks,text,jsonb) to service_role;

create or replace function fleet.retry(p_task bigint)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
begin
    t := fleet._lock_task(p_task);
    if t.state not in ('dead', 'cancelled', 'blocked') then
        perform fleet._raise('LF004',
            format('task %s is %s: only dead, cancelled or blocked tasks can be retried', p_task, t.state));
    end if;
    return fleet._requeue(t, 'retried');
end
$$;
revoke all on function fleet.retry(bigint) from public;
grant execute on function fleet.retry(bigint) to fleet_operator, service_role;

-- An operator's answer to a blocked task: back to the queue. Blocked by its verify gate, the next
-- claim re-runs the gate only (the agent's work is already there); blocked for another reason
-- (a budget), the agent runs again. A new budget (NULL: that limit as it is; 0: none) is set in
-- the same transaction (journaled: budget_set). A task its budget blocked is refused while the
-- budget it would have is spent (the next claim would block it again at once, an attempt and a
-- run for nothing), and every refusal changes nothing: no budget is set either.
create or replace function fleet.resume(p_task bigint, p_max_cost_usd numeric default null,
                                        p_max_tokens bigint default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    v_over text;
begin
    if p_max_cost_usd < 0 or p_max_tokens < 0 then
        perform fleet._raise('LF005', 'a task budget must not be negative');
    end if;
    t := fleet._lock_task(p_task);
    if t.state <> 'blocked' then
        perform fleet._raise('LF004', format('task %s is %s: only blocked tasks can be resumed', p_task, t.state),
            'a dead or cancelled task is retried (`fleet retry`)');
    end if;
    if p_max_cost_usd is not null or p_max_tokens is not null then
        update fleet.tasks
           set max_cost_usd = case when p_max_cost_usd is null then max_cost_usd else nullif(p_max_cost_usd, 0) end,
               max_tokens = case when p_max_tokens is null then max_tokens else nullif(p_max_tokens, 0) end,
               updated_at = now()
         where id = p_task;
        perform fleet._event('budget_set', t.lane, p_task, null,
            jsonb_build_object('max_cost_usd', p_max_cost_usd, 'max_tokens', p_max_tokens,
                               'was', jsonb_build_object('max_cost_usd', t.max_cost_usd, 'max_tokens', t.max_tokens)));
    end if;
    if t.block_reason = 'budget' then
        v_over := fleet._over_budget((select x from fleet.tasks x where x.id = p_task),
                                     (select l from fleet.lanes l where l.name = t.lane));
        if v_over is not null then
            perform fleet._raise('LF004', format('task %s would be blocked again at once: it %s', p_task, v_over),
                'give it a budget it has not spent: `fleet resume TASK --max-cost USD` or `--max-tokens N` (0: none)');
        end if;
    end if;
    update fleet.tasks
       set state = 'queued', run_at = now(), carry_over = true, updated_at = now(),
           verify_pending = t.block_reason in ('automation-broken', 'capability-unavailable'),
           block_reason = null
     where id = p_task;
    perform fleet._event('resumed', t.lane, p_task, null,
        jsonb_build_object('reason', t.block_reason,
                           'gate_only', t.block_reason in ('automation-broken', 'capability-unavailable')));
    return 'queued';
end
$$;
revoke all on function fleet.resume(bigint,numeric,bigint) from public;
grant execute on function fleet.resume(bigint,numeric,bigint) to fleet_operator, service_role;

create or replace function fleet.review_approve(p_task bigint, p_note text default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    r fleet.runs;
begin
    t := fleet._lock_task(p_task);
    if t.state <> 'review' then
        perform fleet._raise('LF004', format('task %s is %s: only tasks in review can be approved', p_task, t.state));
    end if;
    select * into r from fleet.runs where task_id = p_task and outcome = 'done' order by id desc limit 1;
    update fleet.tasks
       set state = 'done', finished_at = now(), updated_at = now(), review_note = null
     where id = p_task;
    perform fleet._event('review_approved', t.lane, p_task, r.session_id,
        jsonb_strip_nulls(jsonb_build_object('note', left(p_note, 2000), 'pool', r.pool, 'profile', r.profile,
            'host', (select host from fleet.sessions where id = r.session_id), 'run', r.id)));
    return 'done';
end
$$;
revoke all on function fleet.review_approve(bigint,text) from public;
grant execute on function fleet.review_approve(bigint,text) to fleet_operator, service_role;

-- Back to the queue with the reviewer's note, which the next attempt's prompt carries. A rejection
-- is not a failed attempt (the agent did finish), so it spends nothing of the attempt cap.
create or replace function fleet.review_reject(p_task bigint, p_note text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    t fleet.tasks;
    r fleet.runs;
begin
    if p_note is null or length(trim(p_note)) = 0 then
        perform fleet._raise('LF005', 'a rejection needs a note: it is what the next attempt is told');
    end if;
    t := fleet._lock_task(p_task);
    if t.state <> 'review' then
        perform fleet._raise('LF004', format('task %s is %s: only tasks in review can be rejected', p_task, t.state));
    end if;
    select * into r from fleet.runs where task_id = p_task and outcome = 'done' order by id desc limit 1;
    update fleet.tasks
       set state = 'queued', run_at = now(), review_note = left(p_note, 8000), updated_at = now()
     where id = p_task;
    perform fleet._event('review_rejected', t.lane, p_task, r.session_id,
        jsonb_strip_nulls(jsonb_build_object('note', left(p_note, 2000), 'pool', r.pool, 'profile', r.profile,
            'host', (select host from fleet.sessions where id = r.session_id), 'run', r.id)));
    return 'queued';
end
$$;
revoke all on function fleet.review_reject(bigint,text) from public;
grant execute on function fleet.review_reject(bigint,text) to fleet_operator, service_role;

-- What a task has spent over all its runs (a task budget counts every attempt).
create or replace function fleet.task_spend(p_task bigint)
returns table (cost_usd numeric, tokens numeric)
language plpgsql
stable
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_lane text;
begin
    -- another lane's task answers as an unknown one
    select lane into v_lane from fleet.tasks where id = p_task and fleet._lane_allowed(lane);
    if not found then
        perform fleet._raise('LF003', format('unknown task %s', p_task));
    end if;
    return query
    select coalesce(sum(r.cost_usd), 0),
           coalesce(sum(r.input_tokens + r.cache_creation_tokens + r.cache_read_tokens + r.output_tokens), 0)
      from fleet.runs r where r.task_id = p_task;
end
$$;
revoke all on function fleet.task_spend(bigint) from public;
grant execute on function fleet.task_spend(bigint) to fleet_operator, fleet_worker, service_role;

-- An operator lifts a pool's throttle (fleet.throttle) before its reset: the pool takes claims
-- again at once, and the tasks that wait for its reset (queued, their last run throttled on this
-- pool) are ready now. A pool is shared by lanes, so this is a fleet-wide call: a key limited to
-- some lanes is refused (LF008). Journaled (throttle_cleared: the reset it had, who set it, how
-- many tasks were released, who cleared it) when it changed something. Returns {"pool",
-- "was_until", "note", "set_by", "tasks"} (was_until null: the pool was not throttled).
create or replace function fleet.clear_throttle(p_pool text)
returns jsonb
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    p fleet.pools;
    v_tasks int;
    v_out jsonb;
begin
    perform fleet._require_lane(null);
    if not exists (select 1 from fleet.pools where name = p_pool) then
        perform fleet._raise('LF005', format('unknown pool %L', left(p_pool, 100)),
            'known pools: ' || coalesce((select string_agg(name, ', ' order by name) from fleet.pools), 'none'));
    end if;
    -- lock order: tasks, then their pool (as fleet.throttle: the task, then its pool)
    with waiting as (
        update fleet.tasks t
           set run_at = now(), updated_at = now()
         where t.state = 'queued' and t.pool = p_pool and t.run_at > now()
           and (select r.outcome from fleet.runs r where r.task_id = t.id order by r.id desc limit 1) = 'throttled'
        returning t.id
    )
    select count(*) into v_tasks from waiting;
    select * into p from fleet.pools where name = p_pool for no key update;
    update fleet.pools
       set throttled_until = null, throttle_note = null, throttled_by = null, updated_at = now()
     where name = p_pool and (throttled_until is not null or throttle_note is not null or throttled_by is not null);
    v_out := jsonb_build_object('pool', p_pool,
                                'was_until', case when p.throttled_until > now() then p.throttled_until end,
                                'note', p.throttle_note, 'set_by', p.throttled_by, 'tasks', v_tasks);
    if p.throttled_until > now() or v_tasks > 0 then
        perform fleet._event('throttle_cleared', null, null, null, v_out || jsonb_build_object('by', fleet._caller()));
    end if;
    return v_out;
end
$$;
revoke all on function fleet.clear_throttle(text) from public;
grant execute on function fleet.clear_throttle(text) to fleet_operator, service_role;
