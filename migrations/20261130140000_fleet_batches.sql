-- lanefleet: batches (issue #10, items 2-5).
--
-- A batch runs a few tasks of a lane one after another in one shift, each member in its own git
-- worktree on its own branch batch/<id>-m<n>-<key> cut from the batch's integration branch
-- batch/<id>; a member whose verify gate passes is landed on the integration branch fast-forward
-- only; one whose gate says task-failed is evicted (back to the queue as an ordinary task); an
-- inconclusive gate or a failed landing blocks the batch until `fleet resume --batch ID`.
--
-- A batch is carried by a task: the carrier is an ordinary row of fleet.tasks in the lane (kind
-- 'batch', key batch:<id>, payload {"batch": id}), so claiming it takes one slot, and the lease,
-- heartbeat, hand-off, monitor repair and attempt cap apply to it unchanged. Its members wait in
-- the task state `batched`, which no claim takes. Every step of a batch is one function below,
-- fenced by the carrier's lease, with its journal event (kinds batch_*), so a shift that takes a
-- carrier over (after a repair or a hand-off) continues the same member from the database.

------------------------------------------------------------------------------------------------
-- tables

create table fleet.batches (
    id bigint generated always as identity primary key,
    lane text not null references fleet.lanes (name) on update cascade,
    task_id bigint constraint batch_carrier_unique unique references fleet.tasks (id) on delete set null,
    state text not null default 'open'
        constraint batch_state check (state in ('open', 'running', 'blocked', 'done', 'cancelled')),
    profile text,                      -- the dispatch profile of every member and every recovery
    base text,                         -- the base branch the integration branch was made from
    integration_branch text,           -- batch/<id>, once set up
    current_n int,                     -- the member being worked (null: none yet, or the tail)
    block_reason text,
    report jsonb not null default '{}' constraint batch_report_object check (jsonb_typeof(report) = 'object'),
    created_at timestamptz not null default now(),
    finished_at timestamptz,
    constraint batch_blocked_has_reason check ((state = 'blocked') = (block_reason is not null)),
    constraint batch_finished_has_time check ((state in ('done', 'cancelled')) = (finished_at is not null))
);

comment on table fleet.batches is
    'A batch: members of one lane run one after another by the shift holding its carrier task, '
    'landed on one integration branch, shipped once.';

create table fleet.batch_members (
    batch_id bigint not null references fleet.batches (id) on delete cascade,
    n int not null constraint batch_member_n_positive check (n >= 1),
    task_id bigint not null references fleet.tasks (id) on delete cascade,
    state text not null default 'pending'
        constraint batch_member_state check (state in ('pending', 'running', 'landed', 'evicted', 'released')),
    branch text,
    worktree text,
    cut_sha text,                      -- the integration head the member branch was cut from
    head_sha text,                     -- the member's head when it landed
    landed_from text,                  -- the integration head before the landing
    landed_to text,                    -- and after
    gate text,                         -- pending (the agent exited 0), then the gate's outcome
    evidence text,
    tokens bigint not null default 0 constraint batch_member_tokens_non_negative check (tokens >= 0),
    cost_usd numeric(14, 6) not null default 0 constraint batch_member_cost_non_negative check (cost_usd >= 0),
    started_at timestamptz,
    ended_at timestamptz,
    primary key (batch_id, n)
);

comment on table fleet.batch_members is
    'The members of a batch in their order: branch, worktree, cut point, landed range, gate, spend.';

create index batch_members_task on fleet.batch_members (task_id);
create index batches_lane_state on fleet.batches (lane, state);

alter table fleet.tasks
    add column kind text not null default 'task' constraint task_kind check (kind in ('task', 'batch')),
    add column batch_id bigint;        -- a carrier's batch, or a member's while it is batched

alter table fleet.tasks drop constraint task_state;
alter table fleet.tasks add constraint task_state
    check (state in ('queued', 'running', 'done', 'dead', 'cancelled', 'blocked', 'review', 'batched'));

------------------------------------------------------------------------------------------------
-- helpers

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

------------------------------------------------------------------------------------------------
-- the operator: make a batch, read it, resume it

-- Members must be queued ordinary tasks of the lane, 1 to p_max of them, run in the order given.
-- They wait as `batched`; the carrier is queued at the members' highest priority. Returns the
-- batch id. p_profile (a fleet.profiles name) is what every member and recovery dispatches with.
create or replace function fleet.batch_create(p_lane text, p_keys text[], p_max int default 4,
                                              p_profile text default null)
returns bigint
language plpgsql
as $$
declare
    l fleet.lanes;
    v_batch bigint;
    v_carrier bigint;
    v_key text;
    v_n int := 0;
    t fleet.tasks;
    v_priority int;
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
    if p_profile is not null and not exists (select 1 from fleet.profiles where name = p_profile) then
        perform fleet._raise('LF005', format('unknown profile %L', p_profile),
            'known profiles: ' || coalesce((select string_agg(name, ', ' order by name) from fleet.profiles), 'none'));
    end if;
    -- lock the members in id order (as every bulk call does), then check each
    perform 1 from fleet.tasks where key = any (p_keys) order by id for no key update;
    foreach v_key in array p_keys loop
        select * into t from fleet.tasks where key = v_key;
        if not found then
            perform fleet._raise('LF003', format('unknown task %L', v_key));
        end if;
        if t.lane <> p_lane or t.state <> 'queued' or t.kind <> 'task' then
            perform fleet._raise('LF004',
                format('task %L is %s in lane %s: a batch takes queued tasks of lane %s', v_key,
                       case when t.kind = 'batch' then 'a batch carrier' else t.state end, t.lane, p_lane));
        end if;
    end loop;
    select max(priority) into v_priority from fleet.tasks where key = any (p_keys);

    insert into fleet.batches (lane, profile) values (p_lane, p_profile) returning id into v_batch;
    select e.task_id into v_carrier
      from fleet.enqueue_task(p_lane, 'batch:' || v_batch, jsonb_build_object('batch', v_batch), v_priority,
                              now(), null, format('batch %s (%s members)', v_batch, cardinality(p_keys)),
                              null, p_profile) e;
    update fleet.tasks set kind = 'batch', batch_id = v_batch where id = v_carrier;
    update fleet.batches set task_id = v_carrier where id = v_batch;
    foreach v_key in array p_keys loop
        v_n := v_n + 1;
        select * into t from fleet.tasks where key = v_key;
        insert into fleet.batch_members (batch_id, n, task_id) values (v_batch, v_n, t.id);
        update fleet.tasks set state = 'batched', batch_id = v_batch, updated_at = now() where id = t.id;
        perform fleet._event('batched', p_lane, t.id, null, jsonb_build_object('batch', v_batch, 'n', v_n));
    end loop;
    perform fleet._event('batch_created', p_lane, v_carrier, null,
        jsonb_build_object('batch', v_batch, 'members', to_jsonb(p_keys), 'profile', p_profile));
    return v_batch;
end
$$;

-- A lane's `batch_size`: the shift composes a batch of its lane's ready tasks in claim order
-- (priority, then age) before it claims, at most p_size of them; none (null) when fewer than two
-- are ready. Tasks that failed before (an evicted member), resume a blocked run or re-run a gate
-- stay ordinary tasks. Concurrent shifts skip each other's candidates.
create or replace function fleet.batch_compose(p_lane text, p_size int, p_profile text default null)
returns bigint
language plpgsql
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
           and t.failures = 0 and not t.resume and not t.verify_pending
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

-- A batch with its members (JSON), for operators and for the shift holding its carrier.
create or replace function fleet.batch_get(p_batch bigint)
returns jsonb
language plpgsql
stable
as $$
declare
    v_lane text;
begin
    select lane into v_lane from fleet.batches where id = p_batch;
    if not found then
        perform fleet._raise('LF003', format('unknown batch %s', p_batch));
    end if;
    perform fleet._require_lane(v_lane);
    return fleet._batch_json(p_batch);
end
$$;

-- `fleet resume --batch ID`: the blocked carrier goes back to the queue (fleet.resume); the shift
-- that claims it continues the same member: re-runs its gate, or its landing.
create or replace function fleet.batch_resume(p_batch bigint)
returns text
language plpgsql
as $$
declare
    b fleet.batches;
    v_state text;
begin
    select * into b from fleet.batches where id = p_batch;
    if not found then
        perform fleet._raise('LF003', format('unknown batch %s', p_batch));
    end if;
    perform fleet._require_lane(b.lane);
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

------------------------------------------------------------------------------------------------
-- the shift holding the carrier: one function per step, fenced by the carrier's lease

-- The integration branch exists (made from p_base, pushed). Idempotent: the setup event is
-- written once. Returns the batch as JSON (what the shift runs from).
create or replace function fleet.batch_setup(p_carrier bigint, p_token uuid, p_base text, p_branch text)
returns jsonb
language plpgsql
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

-- Member p_n is the current one, on p_branch in p_worktree, cut at p_cut_sha. A takeover calls
-- it again for the same member: the first cut point stays, the event is written once per member.
create or replace function fleet.batch_member_start(p_carrier bigint, p_token uuid, p_n int, p_branch text,
                                                    p_worktree text, p_cut_sha text)
returns text
language plpgsql
as $$
declare
    b fleet.batches;
    m fleet.batch_members;
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
    return 'running';
end
$$;

-- The member's gate state: 'pending' once its agent exited 0 (a takeover re-runs the gate, not
-- the agent), then the gate's outcome; with the spend of the member's agent so far.
create or replace function fleet.batch_member_gate(p_carrier bigint, p_token uuid, p_n int, p_gate text,
                                                   p_evidence text default null, p_tokens bigint default null,
                                                   p_cost numeric default null)
returns text
language plpgsql
as $$
declare
    b fleet.batches;
    m fleet.batch_members;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    m := fleet._batch_member(b.id, p_n);
    if m.state <> 'running' then
        perform fleet._raise('LF004', format('member %s of batch %s is %s, not running', p_n, b.id, m.state));
    end if;
    update fleet.batch_members
       set gate = p_gate, evidence = coalesce(right(p_evidence, 4000), evidence),
           tokens = tokens + coalesce(p_tokens, 0), cost_usd = cost_usd + coalesce(p_cost, 0)
     where batch_id = b.id and n = p_n;
    return p_gate;
end
$$;

-- The member landed: the integration branch went p_from → p_to. Idempotent: a member landed
-- already is recorded once (the call after a crash between the push and this record answers
-- 'landed' and changes nothing). The member's task is done.
create or replace function fleet.batch_member_landed(p_carrier bigint, p_token uuid, p_n int, p_from text,
                                                     p_to text, p_gate text default 'ok',
                                                     p_tokens bigint default null, p_cost numeric default null)
returns text
language plpgsql
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
       set state = 'landed', head_sha = p_to, landed_from = p_from, landed_to = p_to, gate = p_gate,
           tokens = tokens + coalesce(p_tokens, 0), cost_usd = cost_usd + coalesce(p_cost, 0), ended_at = now()
     where batch_id = b.id and n = p_n;
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

-- The member is evicted (its gate said task-failed, or its agent failed): nothing of it landed.
-- Its task goes back to the queue as an ordinary task with one more failure, or to the dead
-- letter when that spends its cap. Idempotent like the landing.
create or replace function fleet.batch_member_evicted(p_carrier bigint, p_token uuid, p_n int, p_evidence text,
                                                      p_gate text default 'task-failed',
                                                      p_tokens bigint default null, p_cost numeric default null)
returns text
language plpgsql
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
       set state = 'evicted', gate = p_gate, evidence = right(p_evidence, 4000),
           tokens = tokens + coalesce(p_tokens, 0), cost_usd = cost_usd + coalesce(p_cost, 0), ended_at = now()
     where batch_id = b.id and n = p_n;
    select * into t from fleet.tasks where id = m.task_id for no key update;
    v_state := case when t.failures + 1 + t.evaporations >= fleet._cap(t) then 'dead' else 'queued' end;
    update fleet.tasks
       set state = v_state, batch_id = null, failures = failures + 1, updated_at = now(), run_at = now(),
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

-- The member's worktree was removed (after its landing or eviction): the journal says so.
create or replace function fleet.batch_member_torn_down(p_carrier bigint, p_token uuid, p_n int)
returns void
language plpgsql
as $$
declare
    b fleet.batches;
begin
    b := fleet._batch_fenced(p_carrier, p_token);
    perform fleet._event('batch_torn_down', b.lane, p_carrier, null, jsonb_build_object('batch', b.id, 'n', p_n));
end
$$;

-- The batch is blocked (an inconclusive gate, a landing that cannot fast-forward, a failed tail):
-- the carrier is blocked through fleet.block and the batch records why, until `fleet resume
-- --batch`. p_n: the member it stopped at (null: the tail).
create or replace function fleet.batch_block(p_carrier bigint, p_token uuid, p_reason text,
                                             p_evidence text default null, p_n int default null)
returns text
language plpgsql
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

-- A step of the tail is done: p_step 'batch_verify' or 'ship', its outcome in the report (a
-- takeover skips what is recorded). 'ship' writes the shipped event.
create or replace function fleet.batch_tail(p_carrier bigint, p_token uuid, p_step text, p_outcome jsonb)
returns void
language plpgsql
as $$
declare
    b fleet.batches;
begin
    if p_step not in ('batch_verify', 'ship') then
        perform fleet._raise('LF005', format('%L is not a step of a batch''s tail', p_step), 'batch_verify or ship');
    end if;
    b := fleet._batch_fenced(p_carrier, p_token);
    update fleet.batches set report = report || jsonb_build_object(p_step, p_outcome), current_n = null
     where id = b.id;
    if p_step = 'ship' then
        perform fleet._event('batch_shipped', b.lane, p_carrier, null,
            jsonb_build_object('batch', b.id) || coalesce(p_outcome, '{}'));
    end if;
end
$$;

-- The batch is done: its report recorded, the carrier completed. Every member must have landed
-- or been evicted.
create or replace function fleet.batch_finish(p_carrier bigint, p_token uuid, p_report jsonb)
returns text
language plpgsql
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

create trigger batch_carrier_ended after update of state on fleet.tasks
    for each row when (new.kind = 'batch' and new.state in ('dead', 'cancelled') and old.state is distinct from new.state)
    execute function fleet._batch_carrier_ended();

------------------------------------------------------------------------------------------------
-- the view

create view fleet.batch_overview as
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

------------------------------------------------------------------------------------------------
-- security: as in 20261130100400_fleet_roles_rls.sql

do $$
declare
    f regprocedure;
begin
    for f in
        select p.oid::regprocedure
          from pg_catalog.pg_proc p
          join pg_catalog.pg_namespace n on n.oid = p.pronamespace
         where n.nspname = 'fleet'
           and p.proname in ('batch_create', 'batch_compose', 'batch_get', 'batch_resume', 'batch_setup', 'batch_member_start',
                             'batch_member_gate', 'batch_member_landed', 'batch_member_evicted',
                             'batch_member_torn_down', 'batch_block', 'batch_tail', 'batch_finish')
         order by p.oid
    loop
        execute format('alter function %s security definer set search_path = pg_catalog, fleet, pg_temp', f);
    end loop;
end
$$;

revoke execute on function fleet._batch_fenced(bigint, uuid), fleet._batch_member(bigint, int),
    fleet._batch_json(bigint), fleet._batch_carrier_ended(),
    fleet.batch_create(text, text[], int, text), fleet.batch_compose(text, int, text),
    fleet.batch_get(bigint), fleet.batch_resume(bigint),
    fleet.batch_setup(bigint, uuid, text, text),
    fleet.batch_member_start(bigint, uuid, int, text, text, text),
    fleet.batch_member_gate(bigint, uuid, int, text, text, bigint, numeric),
    fleet.batch_member_landed(bigint, uuid, int, text, text, text, bigint, numeric),
    fleet.batch_member_evicted(bigint, uuid, int, text, text, bigint, numeric),
    fleet.batch_member_torn_down(bigint, uuid, int),
    fleet.batch_block(bigint, uuid, text, text, int),
    fleet.batch_tail(bigint, uuid, text, jsonb),
    fleet.batch_finish(bigint, uuid, jsonb)
    from public;
grant execute on function
    fleet.batch_create(text, text[], int, text), fleet.batch_compose(text, int, text),
    fleet.batch_get(bigint), fleet.batch_resume(bigint),
    fleet.batch_setup(bigint, uuid, text, text),
    fleet.batch_member_start(bigint, uuid, int, text, text, text),
    fleet.batch_member_gate(bigint, uuid, int, text, text, bigint, numeric),
    fleet.batch_member_landed(bigint, uuid, int, text, text, text, bigint, numeric),
    fleet.batch_member_evicted(bigint, uuid, int, text, text, bigint, numeric),
    fleet.batch_member_torn_down(bigint, uuid, int),
    fleet.batch_block(bigint, uuid, text, text, int),
    fleet.batch_tail(bigint, uuid, text, jsonb),
    fleet.batch_finish(bigint, uuid, jsonb)
    to service_role;
-- the shift holding a carrier runs the batch; operators make, read and resume batches
grant execute on function
    fleet.batch_compose(text, int, text),  -- a lane's batch_size: the shift composes before it claims
    fleet.batch_get(bigint),
    fleet.batch_setup(bigint, uuid, text, text),
    fleet.batch_member_start(bigint, uuid, int, text, text, text),
    fleet.batch_member_gate(bigint, uuid, int, text, text, bigint, numeric),
    fleet.batch_member_landed(bigint, uuid, int, text, text, text, bigint, numeric),
    fleet.batch_member_evicted(bigint, uuid, int, text, text, bigint, numeric),
    fleet.batch_member_torn_down(bigint, uuid, int),
    fleet.batch_block(bigint, uuid, text, text, int),
    fleet.batch_tail(bigint, uuid, text, jsonb),
    fleet.batch_finish(bigint, uuid, jsonb)
    to fleet_worker;
grant execute on function fleet.batch_create(text, text[], int, text), fleet.batch_get(bigint),
    fleet.batch_resume(bigint)
    to fleet_operator;

grant select on fleet.batches, fleet.batch_members to fleet_worker, fleet_operator;
grant select on fleet.batch_overview to fleet_operator;  -- never to workers: a view reads past RLS
grant all on fleet.batches, fleet.batch_members to service_role;
grant all on all sequences in schema fleet to service_role;

alter table fleet.batches enable row level security;
alter table fleet.batch_members enable row level security;
create policy batches_service on fleet.batches to service_role using (true) with check (true);
create policy batch_members_service on fleet.batch_members to service_role using (true) with check (true);
create policy batches_of_the_key on fleet.batches for select to fleet_worker, fleet_operator using (
    (select fleet._allowed_lanes()) is null or lane = any ((select fleet._allowed_lanes())::text[]));
create policy batch_members_of_the_key on fleet.batch_members for select to fleet_worker, fleet_operator using (
    exists (select 1 from fleet.batches b where b.id = batch_id
             and ((select fleet._allowed_lanes()) is null or b.lane = any ((select fleet._allowed_lanes())::text[]))));

notify pgrst, 'reload schema';
