-- Integration-branch batches: members run one after another in one slot and land on one branch.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- Members must be queued ordinary tasks of the lane, named by their keys in the lane (keys are per
-- lane), 1 to p_max of them, run in the order given. They wait as `batched`; the carrier (key
-- batch:<id> in the lane) is queued at the members' highest priority. Returns the batch id.
-- p_profile (a fleet.profiles name) is what every member and recovery dispatches with.
create or replace function fleet.batch_create(p_lane text, p_keys text[], p_max int default 4,
                                              p_profile text default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    l fleet.lanes;
    v_batch bigint;
    v_carrier bigint;
    v_key text;
    v_n int := 0;
    t fleet.tasks;
    v_priority int;
    v_created boolean;
begin
    perform fleet._require_lane(p_lane);
    l := fleet._lane(p_lane);
    if p_max is null or p_max < 1 or p_max > 100 then
        perform fleet._raise('LF005', format('a batch''s --max must be between 1 and 100, not %s', p_max));
    end if;
    if p_keys is null or cardinality(p_keys) = 0 then
        perform fleet._raise('LF005', 'a batch needs at least one member');
    end if;
    if cardinality(p_keys) > p_max then
        perform fleet._raise('LF005', format('%s members are more than the batch''s maximum of %s',
                                             cardinality(p_keys), p_max), 'raise --max or make two batches');
    end if;
    if (select count(distinct k) from unnest(p_keys) k) <> cardinality(p_keys) then
        perform fleet._raise('LF005', 'a task can be a member of a batch only once');
    end if;
    if p_profile is not null and not fleet._profile_known(p_lane, p_profile) then
        perform fleet._raise('LF005', format('unknown profile %L', left(p_profile, 100)), fleet._profiles_hint(p_lane));
    end if;
    -- lock the members in id order (as every bulk call does), then check each
    perform 1 from fleet.tasks where key = any (p_keys) and lane = p_lane order by id for no key update;
    foreach v_key in array p_keys loop
        select * into t from fleet.tasks where key = v_key and lane = p_lane;
        if not found then
            perform fleet._raise('LF003', format('unknown task %L in lane %s', left(v_key, 100), p_lane),
                'a batch takes queued tasks of its lane, named by their keys in it');
        end if;
        if t.state <> 'queued' or t.kind <> 'task' then
            perform fleet._raise('LF004',
                format('task %L is %s in lane %s: a batch takes queued tasks of lane %s', v_key,
                       case when t.kind = 'batch' then 'a batch carrier' else t.state end, t.lane, p_lane));
        end if;
    end loop;
    select max(priority) into v_priority from fleet.tasks where key = any (p_keys) and lane = p_lane;

    insert into fleet.batches (lane, profile) values (p_lane, p_profile) returning id into v_batch;
    select e.task_id, e.created into v_carrier, v_created
      from fleet.enqueue_task(p_lane, 'batch:' || v_batch, jsonb_build_object('batch', v_batch), v_priority,
                              now(), null, format('batch %s (%s members)', v_batch, cardinality(p_keys)),
                              null, p_profile) e;
    if not v_created then  -- a task of the lane took the carrier's key: never turn it into a carrier
        perform fleet._raise('LF004', format('lane %s already has a task of key %L, the key of batch %s''s carrier',
                                             p_lane, 'batch:' || v_batch, v_batch),
            'keys batch:<n> are the carriers'': cancel that task and enqueue it under another key, then make the batch again');
    end if;
    update fleet.tasks set kind = 'batch', batch_id = v_batch where id = v_carrier;
    update fleet.batches set task_id = v_carrier where id = v_batch;
    foreach v_key in array p_keys loop
        v_n := v_n + 1;
        select * into t from fleet.tasks where key = v_key and lane = p_lane;
        insert into fleet.batch_members (batch_id, n, task_id) values (v_batch, v_n, t.id);
        update fleet.tasks set state = 'batched', batch_id = v_batch, updated_at = now() where id = t.id;
        perform fleet._event('batched', p_lane, t.id, null, jsonb_build_object('batch', v_batch, 'n', v_n));
    end loop;
    perform fleet._event('batch_created', p_lane, v_carrier, null,
        jsonb_build_object('batch', v_batch, 'members', to_jsonb(p_keys), 'profile', p_profile));
    return v_batch;
end
$$;
revoke all on function fleet.batch_create(text,text[],integer,text) from public;
grant execute on function fleet.batch_create(text,text[],integer,text) to fleet_operator, service_role;

-- A lane's `batch_size`: the shift composes a batch of its lane's ready tasks in claim order
-- (priority, then age) before it claims, at most p_size of them; none (null) when fewer than two
-- are ready. Tasks that failed before (an evicted member), resume a blocked run or re-run a gate
-- stay ordinary tasks. Concurrent shifts skip each other's candidates.
create or replace function fleet.batch_compose(p_lane text, p_size int, p_profile text default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_keys text[];
begin
    perform fleet._require_lane(p_lane);
    if p_size is null or p_size < 2 then
        perform fleet._raise('LF005', format('a batch size must be 2 or more, not %s', p_size));
    end if;
    -- the candidates, locked (skip locked: another shift composing at the same time takes others)
    with ready as (
        select t.id, t.key, t.priority, t.run_at
          from fleet.tasks t
         where t.lane = p_lane and t.state = 'queued' and t.kind = 'task' and t.run_at <= now()
           and t.failures = 0 and not t.carry_over and not t.verify_pending
         order by t.priority desc, t.run_at, t.id
         limit p_size
           for no key update skip locked
    )
    select array_agg(key order by priority desc, run_at, id) into v_keys from ready;
    if coalesce(cardinality(v_keys), 0) < 2 then
        return null;
    end if;
    return fleet.batch_create(p_lane, v_keys, p_size, p_profile);
end
$$;
revoke all on function fleet.batch_compose(text,integer,text) from public;
grant execute on function fleet.batch_compose(text,integer,text) to fleet_worker, service_role;

-- A batch with its members (JSON), for operators and for the shift holding its carrier.
create or replace function fleet.batch_get(p_batch bigint)
returns jsonb
language plpgsql
stable
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    v_lane text;
begin
    -- another lane's batch answers as an unknown one
    select lane into v_lane from fleet.batches where id = p_batch and fleet._lane_allowed(lane);
    if not found then
        perform fleet._raise('LF003', format('unknown batch %s', p_batch));
    end if;
    return fleet._batch_json(p_batch);
end
$$;
revoke all on function fleet.batch_get(bigint) from public;
grant execute on function fleet.batch_get(bigint) to fleet_operator, fleet_worker, service_role;

-- `fleet resume --batch ID`: the blocked carrier goes back to the queue (fleet.resume); the shift
-- that claims it continues the same member: re-runs its gate, or its landing.
create or replace function fleet.batch_resume(p_batch bigint)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    b fleet.batches;
    v_state text;
begin
    select * into b from fleet.batches where id = p_batch and fleet._lane_allowed(lane);
    if not found then  -- another lane's batch answers as an unknown one
        perform fleet._raise('LF003', format('unknown batch %s', p_batch));
    end if;
    if b.state <> 'blocked' then
        perform fleet._raise('LF004', format('batch %s is %s: only a blocked batch can be resumed', p_batch, b.state));
    end if;
    v_state := fleet.resume(b.task_id);   -- locks the carrier first (the lock order)
    update fleet.batches set state = 'running', block_reason = null where id = p_batch;
    perform fleet._event('batch_resumed', b.lane, b.task_id, null,
        jsonb_build_object('batch', p_batch, 'reason', b.block_reason, 'n', b.current_n));
    return v_state;
end
$$;
revoke all on function fleet.batch_resume(bigint) from public;
grant execute on function fleet.batch_resume(bigint) to fleet_operator, service_role;

-- The integration branch exists (made from p_base, pushed). Idempotent: the setup event is
-- written once. Returns the batch as JSON (what the shift runs from).
create or replace function fleet.batch_setup(p_carrier bigint, p_token uuid, p_base text, p_branch text)
returns jsonb
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    b fleet.batches;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    if b.integration_branch is null then
        update fleet.batches set integration_branch = p_branch, base = p_base, state = 'running' where id = b.id;
        perform fleet._event('batch_setup', b.lane, p_carrier, null,
            jsonb_build_object('batch', b.id, 'base', p_base, 'branch', p_branch));
    elsif b.state = 'open' then
        update fleet.batches set state = 'running' where id = b.id;
    end if;
    return fleet._batch_json(b.id);
end
$$;
revoke all on function fleet.batch_setup(bigint,uuid,text,text) from public;
grant execute on function fleet.batch_setup(bigint,uuid,text,text) to fleet_worker, service_role;

-- Member p_n is the current one, on p_branch in p_worktree, cut at p_cut_sha. A takeover calls
-- it again for the same member: the first cut point stays, the event is written once per member.
-- Returns 'running', or 'blocked' when the member's agent is to run and its task's earlier runs
-- spent its budget (the member leaves the batch blocked, as fleet.batch_member_blocked).
create or replace function fleet.batch_member_start(p_carrier bigint, p_token uuid, p_n int, p_branch text,
                                                    p_worktree text, p_cut_sha text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    b fleet.batches;
    m fleet.batch_members;
    v_over text;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    m := fleet._batch_member(b.id, p_n);
    if m.state not in ('pending', 'running') then
        perform fleet._raise('LF004', format('member %s of batch %s is %s already', p_n, b.id, m.state));
    end if;
    if exists (select 1 from fleet.batch_members where batch_id = b.id and n < p_n and state in ('pending', 'running')) then
        perform fleet._raise('LF004', format('batch %s: member %s comes before member %s',
            b.id, (select min(n) from fleet.batch_members where batch_id = b.id and n < p_n and state in ('pending', 'running')), p_n));
    end if;
    update fleet.batch_members
       set state = 'running', branch = p_branch, worktree = p_worktree,
           cut_sha = coalesce(cut_sha, p_cut_sha), started_at = coalesce(started_at, now())
     where batch_id = b.id and n = p_n;
    update fleet.batches set current_n = p_n where id = b.id;
    if m.state = 'pending' then
        perform fleet._event('batch_member_advanced', b.lane, p_carrier, null,
            jsonb_build_object('batch', b.id, 'n', p_n, 'task', m.task_id, 'branch', p_branch, 'cut', p_cut_sha));
    end if;
    if m.gate is null then  -- its agent runs next (a member at its gate spends nothing more)
        v_over := fleet._over_budget((select t from fleet.tasks t where t.id = m.task_id),
                                     (select l from fleet.lanes l where l.name = b.lane));
        if v_over is not null then
            perform fleet.batch_member_blocked(p_carrier, p_token, p_n, 'budget', v_over);
            return 'blocked';
        end if;
    end if;
    return 'running';
end
$$;
revoke all on function fleet.batch_member_start(bigint,uuid,integer,text,text,text) from public;
grant execute on function fleet.batch_member_start(bigint,uuid,integer,text,text,text) to fleet_worker, service_role;

-- The member's gate: 'pending' once its agent exited 0 (a takeover re-runs the gate, not the
-- agent; p_usage: the agent's report, which records the member's run), then the gate's outcome,
-- which decides the member's next step (fleet._gate_transition): 'land' (ok), 'evicted'
-- (task-failed: fleet.batch_member_evicted), 'blocked' (the gate could not judge: the batch is
-- blocked, fleet.batch_block). Returns that step, or 'pending'.
create or replace function fleet.batch_member_gate(p_carrier bigint, p_token uuid, p_n int, p_gate text,
                                        p_evidence text default null, p_usage jsonb default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    b fleet.batches;
    m fleet.batch_members;
    v_to text := case when p_gate = 'pending' then 'pending' else fleet._gate_transition(p_gate) end;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    m := fleet._batch_member(b.id, p_n);
    if m.state <> 'running' then
        perform fleet._raise('LF004', format('member %s of batch %s is %s, not running', p_n, b.id, m.state));
    end if;
    if v_to = 'failed' then
        perform fleet.batch_member_evicted(p_carrier, p_token, p_n, coalesce(p_evidence, ''), p_gate, p_usage);
        return 'evicted';
    end if;
    update fleet.batch_members
       set gate = p_gate, evidence = coalesce(right(p_evidence, 4000), evidence)
     where batch_id = b.id and n = p_n;
    perform fleet._batch_member_run(b, m, p_usage,
        case when v_to in ('pending', 'done') then 'done' else 'blocked' end,
        case when p_gate = 'pending' then null else p_gate end,
        case when v_to in ('pending', 'done') then null else p_gate end);
    if v_to = 'blocked' then
        perform fleet.batch_block(p_carrier, p_token, p_gate, p_evidence, p_n);
        return 'blocked';
    end if;
    return case v_to when 'done' then 'land' else 'pending' end;
end
$$;
revoke all on function fleet.batch_member_gate(bigint,uuid,integer,text,text,jsonb) from public;
grant execute on function fleet.batch_member_gate(bigint,uuid,integer,text,text,jsonb) to fleet_worker, service_role;

-- The member landed: the integration branch went p_from → p_to. Idempotent: a member landed
-- already is recorded once (the call after a crash between the push and this record answers
-- 'landed' and changes nothing). The member's task is done, its run too.
create or replace function fleet.batch_member_landed(p_carrier bigint, p_token uuid, p_n int, p_from text, p_to text,
                                          p_gate text default 'ok')
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    b fleet.batches;
    m fleet.batch_members;
    t fleet.tasks;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    m := fleet._batch_member(b.id, p_n);
    if m.state = 'landed' then
        return 'landed';
    end if;
    if m.state <> 'running' then
        perform fleet._raise('LF004', format('member %s of batch %s is %s: it cannot land', p_n, b.id, m.state));
    end if;
    update fleet.batch_members
       set state = 'landed', head_sha = p_to, landed_from = p_from, landed_to = p_to, gate = p_gate, ended_at = now()
     where batch_id = b.id and n = p_n;
    perform fleet._batch_member_run(b, m, null, 'done', p_gate, null);
    select * into t from fleet.tasks where id = m.task_id for no key update;
    update fleet.tasks
       set state = 'done', finished_at = now(), updated_at = now(), batch_id = b.id,
           result = jsonb_build_object('batch', b.id, 'n', p_n, 'gate', p_gate, 'landed_from', p_from,
                                       'landed_to', p_to, 'branch', m.branch)
     where id = m.task_id;
    perform fleet._event('batch_landed', b.lane, p_carrier, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'task', m.task_id, 'from', p_from, 'to', p_to));
    perform fleet._event('completed', t.lane, m.task_id, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'landed_to', p_to));
    return 'landed';
end
$$;
revoke all on function fleet.batch_member_landed(bigint,uuid,integer,text,text,text) from public;
grant execute on function fleet.batch_member_landed(bigint,uuid,integer,text,text,text) to fleet_worker, service_role;

-- The member is evicted (its gate said task-failed, or its agent failed: then p_usage is the
-- agent's report): nothing of it landed. Its run failed; its task goes back to the queue as an
-- ordinary task with one more failure, or to the dead letter when that spends its cap.
-- Idempotent like the landing.
create or replace function fleet.batch_member_evicted(p_carrier bigint, p_token uuid, p_n int, p_evidence text,
                                           p_gate text default 'task-failed', p_usage jsonb default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    b fleet.batches;
    m fleet.batch_members;
    t fleet.tasks;
    v_state text;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    m := fleet._batch_member(b.id, p_n);
    if m.state = 'evicted' then
        return 'evicted';
    end if;
    if m.state not in ('pending', 'running') then
        perform fleet._raise('LF004', format('member %s of batch %s is %s: it cannot be evicted', p_n, b.id, m.state));
    end if;
    update fleet.batch_members
       set state = 'evicted', gate = p_gate, evidence = right(p_evidence, 4000), ended_at = now()
     where batch_id = b.id and n = p_n;
    perform fleet._batch_member_run(b, m, p_usage, 'failed', case when p_usage is null then p_gate end,
        case when p_usage is null then 'verify-failed' else 'agent-failed' end);
    select * into t from fleet.tasks where id = m.task_id for no key update;
    v_state := case when t.failures + 1 + t.evaporations >= fleet._cap(t) then 'dead' else 'queued' end;
    -- a failed attempt: the lane's backoff, as fleet.fail gives one (not claimed again at once)
    update fleet.tasks
       set state = v_state, batch_id = null, failures = failures + 1, updated_at = now(),
           run_at = now() + case when v_state = 'queued'
                                 then fleet._backoff((select l from fleet.lanes l where l.name = t.lane), t.failures)
                                 else interval '0' end,
           last_error = left(format('evicted from batch %s (%s): %s', b.id, p_gate, p_evidence), 4000),
           dead_reason = case when v_state = 'dead' then 'attempt-cap' else dead_reason end,
           finished_at = case when v_state = 'dead' then now() end
     where id = m.task_id;
    perform fleet._event('batch_evicted', b.lane, p_carrier, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'task', m.task_id, 'gate', p_gate, 'to', v_state,
                           'evidence', right(p_evidence, 1000)));
    perform fleet._event('evicted', t.lane, m.task_id, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'gate', p_gate, 'to', v_state));
    return v_state;
end
$$;
revoke all on function fleet.batch_member_evicted(bigint,uuid,integer,text,text,jsonb) from public;
grant execute on function fleet.batch_member_evicted(bigint,uuid,integer,text,text,jsonb) to fleet_worker, service_role;

create or replace function fleet.batch_member_blocked(p_carrier bigint, p_token uuid, p_n int, p_reason text,
                                                      p_evidence text default null, p_usage jsonb default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    b fleet.batches;
    m fleet.batch_members;
    t fleet.tasks;
begin
    if p_reason is null or p_reason !~ '^[a-z][a-z0-9-]{0,62}$' then
        perform fleet._raise('LF005', format('%L is not a block reason', p_reason), 'e.g. budget');
    end if;
    b := fleet._batch_fenced(p_carrier, p_token);
    m := fleet._batch_member(b.id, p_n);
    if m.state = 'evicted' and m.gate = p_reason then
        return 'blocked';  -- recorded already (a call repeated after a lost answer)
    end if;
    if m.state not in ('pending', 'running') then
        perform fleet._raise('LF004', format('member %s of batch %s is %s: it cannot be blocked', p_n, b.id, m.state));
    end if;
    update fleet.batch_members
       set state = 'evicted', gate = p_reason, evidence = right(p_evidence, 4000), ended_at = now()
     where batch_id = b.id and n = p_n;
    perform fleet._batch_member_run(b, m, p_usage, 'blocked', null, p_reason);
    select * into t from fleet.tasks where id = m.task_id for no key update;
    update fleet.tasks
       set state = 'blocked', batch_id = null, block_reason = p_reason, updated_at = now(),
           last_error = left(format('blocked in batch %s (%s): %s', b.id, p_reason, p_evidence), 4000)
     where id = m.task_id;
    perform fleet._event('batch_evicted', b.lane, p_carrier, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'task', m.task_id, 'gate', p_reason, 'to', 'blocked',
                           'evidence', right(p_evidence, 1000)));
    perform fleet._event('blocked', t.lane, m.task_id, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'reason', p_reason, 'evidence', right(p_evidence, 1000)));
    return 'blocked';
end
$$;
comment on function fleet.batch_member_blocked(bigint, uuid, int, text, text, jsonb) is
    'A member leaves its batch blocked (e.g. its task budget is spent): nothing of it landed, the batch goes '
    'on, its task and run are blocked with the reason (no failure counted) until `fleet resume`. Fenced by the '
    'carrier''s lease; p_usage: its agent''s report when the agent ran.';
revoke all on function fleet.batch_member_blocked(bigint,uuid,integer,text,text,jsonb) from public;
grant execute on function fleet.batch_member_blocked(bigint,uuid,integer,text,text,jsonb) to fleet_worker, service_role;

-- The member's worktree was removed (after its landing or eviction): the journal says so.
create or replace function fleet.batch_member_torn_down(p_carrier bigint, p_token uuid, p_n int)
returns void
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    b fleet.batches;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    perform fleet._event('batch_torn_down', b.lane, p_carrier, null, jsonb_build_object('batch', b.id, 'n', p_n));
end
$$;
revoke all on function fleet.batch_member_torn_down(bigint,uuid,integer) from public;
grant execute on function fleet.batch_member_torn_down(bigint,uuid,integer) to fleet_worker, service_role;

-- The batch is blocked (an inconclusive gate, a landing that cannot fast-forward, a failed tail):
-- the carrier is blocked through fleet.block and the batch records why, until `fleet resume
-- --batch`. p_n: the member it stopped at (null: the tail).
create or replace function fleet.batch_block(p_carrier bigint, p_token uuid, p_reason text,
                                             p_evidence text default null, p_n int default null)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    b fleet.batches;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    perform fleet.block(p_carrier, p_token, p_reason, p_evidence);
    update fleet.batches set state = 'blocked', block_reason = p_reason where id = b.id;
    if p_reason = 'landing-failed' then
        perform fleet._event('batch_landing_failed', b.lane, p_carrier, null,
            jsonb_build_object('batch', b.id, 'n', p_n, 'evidence', right(p_evidence, 1000)));
    end if;
    perform fleet._event('batch_blocked', b.lane, p_carrier, null,
        jsonb_build_object('batch', b.id, 'n', p_n, 'reason', p_reason, 'evidence', right(p_evidence, 1000)));
    return 'blocked';
end
$$;
revoke all on function fleet.batch_block(bigint,uuid,text,text,integer) from public;
grant execute on function fleet.batch_block(bigint,uuid,text,text,integer) to fleet_worker, service_role;

-- The batch is done: its report recorded, the carrier completed. Every member must have landed
-- or been evicted.
create or replace function fleet.batch_finish(p_carrier bigint, p_token uuid, p_report jsonb)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    b fleet.batches;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    if exists (select 1 from fleet.batch_members where batch_id = b.id and state in ('pending', 'running')) then
        perform fleet._raise('LF004', format('batch %s still has members to run', b.id));
    end if;
    update fleet.batches
       set state = 'done', finished_at = now(), current_n = null,
           report = report || coalesce(p_report, '{}')
     where id = b.id;
    perform fleet.complete(p_carrier, p_token, jsonb_build_object('batch', b.id) || coalesce(p_report, '{}'));
    perform fleet._event('batch_done', b.lane, p_carrier, null, jsonb_build_object('batch', b.id));
    return 'done';
end
$$;
revoke all on function fleet.batch_finish(bigint,uuid,jsonb) from public;
grant execute on function fleet.batch_finish(bigint,uuid,jsonb) to fleet_worker, service_role;

create or replace function fleet.batch_tail(p_carrier bigint, p_token uuid, p_step text, p_outcome jsonb)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    b fleet.batches;
begin
    if p_step not in ('batch_verify', 'ship_started', 'ship') then
        perform fleet._raise('LF005', format('%L is not a step of a batch''s tail', p_step),
            'batch_verify, ship_started or ship');
    end if;
    if p_outcome is not null and jsonb_typeof(p_outcome) <> 'object' then
        perform fleet._raise('LF005', format('the outcome of %s must be a JSON object', p_step));
    end if;
    b := fleet._batch_fenced(p_carrier, p_token);
    if p_step = 'ship_started' then
        -- every start, kept: how many times the command was started is the evidence of a re-run
        update fleet.batches
           set report = report || jsonb_build_object('ship_started',
                   coalesce(report -> 'ship_started', '[]') || jsonb_build_array(
                       coalesce(p_outcome, '{}') || jsonb_build_object('at', now()))),
               current_n = null
         where id = b.id;
        perform fleet._event('batch_ship_started', b.lane, p_carrier, null,
            jsonb_build_object('batch', b.id, 'rerun', b.report ? 'ship_started') || coalesce(p_outcome, '{}'));
        return 'recorded';
    end if;
    update fleet.batches set report = report || jsonb_build_object(p_step, p_outcome), current_n = null
     where id = b.id;
    if p_step = 'ship' then
        perform fleet._event('batch_shipped', b.lane, p_carrier, null,
            jsonb_build_object('batch', b.id) || coalesce(p_outcome, '{}'));
    elsif fleet._gate_transition(p_outcome ->> 'gate') <> 'done' then
        -- the batch's own gate said no (or could not judge): nothing ships until a person looks
        perform fleet.batch_block(p_carrier, p_token,
            case when p_outcome ->> 'gate' = 'task-failed' then 'batch-verify-failed' else p_outcome ->> 'gate' end,
            p_outcome ->> 'evidence');
        return 'blocked';
    end if;
    return 'recorded';
end
$$;
comment on function fleet.batch_tail(bigint, uuid, text, jsonb) is
    'A step of a batch''s tail: batch_verify or ship with its outcome in the batch''s report, or ship_started '
    'recorded before the ship command runs (a takeover that finds it without a ship outcome re-runs ship '
    'with FLEET_BATCH_SHIP_RERUN=1). A batch_verify whose gate is not ok blocks the batch. Returns '
    'recorded or blocked. Fenced by the carrier''s lease.';
revoke all on function fleet.batch_tail(bigint,uuid,text,jsonb) from public;
grant execute on function fleet.batch_tail(bigint,uuid,text,jsonb) to fleet_worker, service_role;

-- The batch a carrier carries, locked, after the carrier's fence (lock order: the carrier task,
-- then its batch, then member tasks).
create or replace function fleet._batch_fenced(p_carrier bigint, p_token uuid)
returns fleet.batches
language plpgsql
as $$
declare
    t fleet.tasks;
    b fleet.batches;
begin
    t := fleet._fenced(p_carrier, p_token);
    if t.kind <> 'batch' then
        perform fleet._raise('LF005', format('task %s carries no batch', p_carrier));
    end if;
    select * into b from fleet.batches where id = t.batch_id for update;
    if not found then
        perform fleet._raise('LF003', format('no batch for carrier %s', p_carrier));
    end if;
    return b;
end
$$;
revoke all on function fleet._batch_fenced(bigint,uuid) from public;
grant execute on function fleet._batch_fenced(bigint,uuid) to service_role;

create or replace function fleet._batch_member(p_batch bigint, p_n int)
returns fleet.batch_members
language plpgsql
as $$
declare
    m fleet.batch_members;
begin
    select * into m from fleet.batch_members where batch_id = p_batch and n = p_n for update;
    if not found then
        perform fleet._raise('LF003', format('batch %s has no member %s', p_batch, p_n));
    end if;
    return m;
end
$$;
revoke all on function fleet._batch_member(bigint,integer) from public;
grant execute on function fleet._batch_member(bigint,integer) to service_role;

-- Record or update the run of member m: with p_usage (its agent just exited) a closed run of the
-- member's task under the carrier's session is written once (a second report for the same member
-- adds nothing: a takeover re-runs the gate, never the agent); then its outcome, gate and reason
-- follow the member. Returns the run's id (null: the member's agent never reported).
create or replace function fleet._batch_member_run(b fleet.batches, m fleet.batch_members, p_usage jsonb,
                                                   p_outcome text, p_gate text, p_reason text default null)
returns bigint
language plpgsql
as $$
declare
    t fleet.tasks;
    c fleet.tasks;
    v_run bigint := m.run_id;
    u jsonb := fleet._batch_usage(p_usage);
begin
    if v_run is null and u is not null then
        select * into t from fleet.tasks where id = m.task_id;
        select * into c from fleet.tasks where id = b.task_id;
        update fleet.tasks set attempts = attempts + 1 where id = m.task_id
        returning attempts into t.attempts;
        -- (no claim: its start is in no journal entry, start_id NULL; the member's landing is its
        -- batch's event)
        insert into fleet.runs (task_id, session_id, lane, attempt, lease_token, start_id, started_at, ended_at, outcome,
                                exit_code, tier, model, agent_session, profile, pool, reason, gate,
                                input_tokens, cache_creation_tokens, cache_read_tokens, output_tokens, cost_usd,
                                log_path, error_tail)
        values (m.task_id, c.session_id, t.lane, t.attempts, gen_random_uuid(), null, coalesce(m.started_at, now()),
                now(), p_outcome, (u ->> 'exit_code')::int, t.tier, u ->> 'model', u ->> 'agent_session',
                coalesce(b.profile, c.run_profile), c.pool, p_reason, p_gate,
                coalesce((u ->> 'input_tokens')::bigint, 0), coalesce((u ->> 'cache_creation_tokens')::bigint, 0),
                coalesce((u ->> 'cache_read_tokens')::bigint, 0), coalesce((u ->> 'output_tokens')::bigint, 0),
                coalesce((u ->> 'cost_usd')::numeric, 0), u ->> 'log_path', left(u ->> 'error_tail', 4000))
        returning id into v_run;
        update fleet.batch_members
           set run_id = v_run,
               tokens = tokens + coalesce((u ->> 'input_tokens')::bigint, 0)
                               + coalesce((u ->> 'cache_creation_tokens')::bigint, 0)
                               + coalesce((u ->> 'cache_read_tokens')::bigint, 0)
                               + coalesce((u ->> 'output_tokens')::bigint, 0),
               cost_usd = cost_usd + coalesce((u ->> 'cost_usd')::numeric, 0)
         where batch_id = m.batch_id and n = m.n;
        if u ? 'agent_session' then  -- for an evicted member's next attempt, as record_run does
            update fleet.tasks
               set agent_session = u ->> 'agent_session',
                   agent_session_host = case when u ->> 'agent_session' is not null
                                             then (select s.host from fleet.sessions s where s.id = c.session_id) end,
                   agent_session_profile = case when u ->> 'agent_session' is not null
                                                then coalesce(b.profile, c.run_profile) end
             where id = m.task_id;
        end if;
    elsif v_run is not null then
        update fleet.runs
           set outcome = p_outcome, gate = coalesce(p_gate, gate), reason = coalesce(p_reason, reason)
         where id = v_run;
    end if;
    return v_run;
end
$$;
revoke all on function fleet._batch_member_run(fleet.batches,fleet.batch_members,jsonb,text,text,text) from public;
grant execute on function fleet._batch_member_run(fleet.batches,fleet.batch_members,jsonb,text,text,text) to service_role;

-- The usage a member's agent reported (the token and cost fields of a run report), checked:
-- an object whose counts are non-negative integers and whose cost is a non-negative number.
create or replace function fleet._batch_usage(p_usage jsonb)
returns jsonb
language plpgsql
immutable
as $$
declare
    k text;
begin
    if p_usage is null then
        return null;
    end if;
    if jsonb_typeof(p_usage) <> 'object' then
        perform fleet._raise('LF005', 'a member''s usage must be a JSON object',
            'input_tokens, cache_creation_tokens, cache_read_tokens, output_tokens, cost_usd, model, agent_session');
    end if;
    foreach k in array array['input_tokens', 'cache_creation_tokens', 'cache_read_tokens', 'output_tokens', 'cost_usd'] loop
        if p_usage ? k and (jsonb_typeof(p_usage -> k) <> 'number' or (p_usage ->> k)::numeric < 0
                            or (k <> 'cost_usd' and (p_usage ->> k)::numeric <> trunc((p_usage ->> k)::numeric))) then
            perform fleet._raise('LF005', format('a member''s usage has a malformed %s: %s', k, p_usage -> k),
                'token counts are non-negative integers, cost_usd a non-negative number');
        end if;
    end loop;
    return p_usage;
end
$$;
revoke all on function fleet._batch_usage(jsonb) from public;
grant execute on function fleet._batch_usage(jsonb) to service_role;

-- A batch as JSON: the batch row and its members in order (with their task's key, payload,
-- state). What a shift reads at takeover, and `fleet batch show`.
create or replace function fleet._batch_json(p_batch bigint)
returns jsonb
language sql
stable
as $$
    select to_jsonb(b) || jsonb_build_object('members', coalesce((
               select jsonb_agg(to_jsonb(m) || jsonb_build_object(
                          'key', t.key, 'title', t.title, 'payload', t.payload, 'task_state', t.state,
                          'attempts', t.attempts, 'failures', t.failures)
                      order by m.n)
                 from fleet.batch_members m join fleet.tasks t on t.id = m.task_id
                where m.batch_id = b.id), '[]'::jsonb))
      from fleet.batches b
     where b.id = p_batch;
$$;
revoke all on function fleet._batch_json(bigint) from public;
grant execute on function fleet._batch_json(bigint) to service_role;

-- A carrier that dies (its attempt cap) or is cancelled ends its batch: members not landed or
-- evicted go back to the queue as ordinary tasks, no failure counted ('released').
create or replace function fleet._batch_carrier_ended()
returns trigger
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    m record;
begin
    update fleet.batches set state = 'cancelled', finished_at = now(), block_reason = null
     where id = new.batch_id and state not in ('done', 'cancelled');
    for m in select bm.n, bm.task_id from fleet.batch_members bm
              where bm.batch_id = new.batch_id and bm.state in ('pending', 'running') order by bm.task_id loop
        update fleet.batch_members set state = 'released', ended_at = now() where batch_id = new.batch_id and n = m.n;
        update fleet.tasks set state = 'queued', batch_id = null, run_at = now(), updated_at = now()
         where id = m.task_id and state = 'batched';
        perform fleet._event('released', new.lane, m.task_id, null,
            jsonb_build_object('batch', new.batch_id, 'carrier', new.state));
    end loop;
    return null;
end
$$;
revoke all on function fleet._batch_carrier_ended() from public;
grant execute on function fleet._batch_carrier_ended() to service_role;

create or replace view fleet.batch_overview as
select b.id,
       b.lane,
       b.state,
       b.task_id as carrier,
       b.profile,
       b.integration_branch,
       count(m.*) as members,
       count(m.*) filter (where m.state = 'landed') as landed,
       count(m.*) filter (where m.state = 'evicted') as evicted,
       count(m.*) filter (where m.state in ('pending', 'running')) as pending,
       b.current_n,
       b.block_reason,
       coalesce(sum(m.tokens), 0)::bigint as tokens,
       coalesce(sum(m.cost_usd), 0)::numeric(14, 6) as cost_usd,
       b.created_at,
       b.finished_at,
       coalesce(b.finished_at, now()) - b.created_at as wall_clock,
       b.report -> 'ship' as ship
  from fleet.batches b
  left join fleet.batch_members m on m.batch_id = b.id
 where fleet._lane_allowed(b.lane)
 group by b.id;
comment on view fleet.batch_overview is 'Per batch: its state, members landed, evicted and pending, spend, wall-clock, ship result.';
comment on column fleet.batch_overview.id is 'the batch';
comment on column fleet.batch_overview.lane is 'its lane';
comment on column fleet.batch_overview.state is 'open (not claimed yet), running, blocked, done or cancelled';
comment on column fleet.batch_overview.carrier is 'the task that carries it (key batch:<id>)';
comment on column fleet.batch_overview.profile is 'the dispatch profile recorded at creation';
comment on column fleet.batch_overview.integration_branch is 'batch/<id>, once set up';
comment on column fleet.batch_overview.members is 'members in all';
comment on column fleet.batch_overview.landed is 'members landed on the integration branch';
comment on column fleet.batch_overview.evicted is 'members evicted (back to the queue or dead)';
comment on column fleet.batch_overview.pending is 'members not run to the end yet';
comment on column fleet.batch_overview.current_n is 'the member being worked (null: none, or the tail)';
comment on column fleet.batch_overview.block_reason is 'why a blocked batch waits (automation-broken, capability-unavailable, landing-failed, ...)';
comment on column fleet.batch_overview.tokens is 'tokens the members'' agents spent (all kinds)';
comment on column fleet.batch_overview.cost_usd is 'their cost';
comment on column fleet.batch_overview.created_at is 'when the batch was made';
comment on column fleet.batch_overview.finished_at is 'when it finished';
comment on column fleet.batch_overview.wall_clock is 'created to finished (or to now)';
comment on column fleet.batch_overview.ship is 'the ship command''s outcome (exit code, output tail), once shipped';
grant select on fleet.batch_overview to fleet_operator;
grant all on fleet.batch_overview to service_role;
