-- lanefleet: guard rails for agent fleets (issue #9): stalls and needs-attention, task and lane
-- budgets, review debt. (Workspaces and `fleet guard` have migrations of their own.)
--
-- Lane settings (fleet.lanes.config, from fleet.toml): stall_seconds + stall_action (report | stop),
-- max_cost_usd / max_tokens (a task's default budget; the shift enforces it as the run streams),
-- daily_budget_usd / daily_budget_tokens (the lane claims nothing past them until the next UTC
-- day), review (a completed task waits in `review`) and review_cap (no claims while that many wait).

------------------------------------------------------------------------------------------------
-- tables

alter table fleet.tasks
    add column max_cost_usd numeric(14, 6) constraint task_max_cost_positive check (max_cost_usd is null or max_cost_usd > 0),
    add column max_tokens bigint constraint task_max_tokens_positive check (max_tokens is null or max_tokens > 0),
    add column review_note text,      -- a reviewer's note for the next attempt (a rejection)
    add column attention text,        -- what a running agent waits for (a question, a permission prompt)
    add column attention_at timestamptz;

alter table fleet.tasks drop constraint task_state;
alter table fleet.tasks add constraint task_state
    check (state in ('queued', 'running', 'done', 'dead', 'cancelled', 'blocked', 'review'));

create index tasks_review on fleet.tasks (lane) where state = 'review';
-- a lane's spend today (its daily budget)
create index runs_lane_started on fleet.runs (lane, started_at)
    include (cost_usd, input_tokens, cache_creation_tokens, cache_read_tokens, output_tokens);

------------------------------------------------------------------------------------------------
-- helpers

-- What a completed task of the lane becomes: review when the lane requires one, else done.
create or replace function fleet._done_state(p_lane text)
returns text
language sql
stable
as $$
    select case when coalesce((select (config ->> 'review')::boolean from fleet.lanes where name = p_lane), false)
                then 'review' else 'done' end;
$$;

-- The lane's spend since midnight UTC (runs started today): cost and tokens of every kind.
create or replace function fleet._lane_spend_today(p_lane text)
returns table (cost_usd numeric, tokens numeric)
language sql
stable
as $$
    select coalesce(sum(r.cost_usd), 0),
           coalesce(sum(r.input_tokens + r.cache_creation_tokens + r.cache_read_tokens + r.output_tokens), 0)
      from fleet.runs r
     where r.lane = p_lane
       and r.started_at >= (date_trunc('day', now() at time zone 'UTC') at time zone 'UTC');
$$;

-- What a task has spent over all its runs (a task budget counts every attempt).
create or replace function fleet.task_spend(p_task bigint)
returns table (cost_usd numeric, tokens numeric)
language plpgsql
stable
as $$
declare
    v_lane text;
begin
    select lane into v_lane from fleet.tasks where id = p_task;
    if not found then
        perform fleet._raise('LF003', format('unknown task %s', p_task));
    end if;
    if not fleet._lane_allowed(v_lane) then
        perform fleet._raise('LF008', format('lane %L is not allowed for this key', v_lane));
    end if;
    return query
    select coalesce(sum(r.cost_usd), 0),
           coalesce(sum(r.input_tokens + r.cache_creation_tokens + r.cache_read_tokens + r.output_tokens), 0)
      from fleet.runs r where r.task_id = p_task;
end
$$;

------------------------------------------------------------------------------------------------
-- enqueue: with a tier, a profile (both checked now, never at run time) and a task budget

-- (20261130120000_fleet_dispatch.sql dropped the first enqueue_task and enqueue_after; these take
-- a tier, a profile and a budget as well)

create function fleet.enqueue_task(
    p_lane text, p_key text, p_payload jsonb default '{}', p_priority int default 0,
    p_run_at timestamptz default now(), p_max_attempts int default null, p_title text default null,
    p_tier text default null, p_profile text default null, p_max_cost_usd numeric default null,
    p_max_tokens bigint default null)
returns table (task_id bigint, created boolean)
language plpgsql
as $$
#variable_conflict use_column
declare
    v_id bigint;
    v_lane text;
    l fleet.lanes;
begin
    perform fleet._require_lane(p_lane);
    if p_key is null or length(p_key) = 0 or length(p_key) > 200 then
        perform fleet._raise('LF005', 'task key must be 1 to 200 characters');
    end if;
    l := fleet._lane(p_lane);
    if p_payload is not null and jsonb_typeof(p_payload) <> 'object' then
        perform fleet._raise('LF005',
            format('payload must be a JSON object, not a JSON %s', jsonb_typeof(p_payload)));
    end if;
    if p_priority is null or p_priority not between 0 and 1000 then
        perform fleet._raise('LF005', format('priority must be between 0 and 1000, not %s', p_priority),
            'higher runs first; the default is 0');
    end if;
    if p_max_attempts is not null and p_max_attempts < 1 then
        perform fleet._raise('LF005', format('max_attempts must be at least 1, not %s', p_max_attempts));
    end if;
    if p_tier is not null and not (p_tier = any (fleet._tiers(l))) then
        perform fleet._raise('LF005', format('lane %s has no tier %L', p_lane, p_tier),
            case when cardinality(fleet._tiers(l)) = 0 then 'the lane names no tiers'
                 else 'its tiers, lowest first: ' || array_to_string(fleet._tiers(l), ', ') end);
    end if;
    if (p_max_cost_usd is not null and p_max_cost_usd <= 0) or (p_max_tokens is not null and p_max_tokens <= 0) then
        perform fleet._raise('LF005', 'a task budget must be positive',
            format('--max-cost %s, --max-tokens %s', p_max_cost_usd, p_max_tokens));
    end if;
    if p_profile is not null and not exists (select 1 from fleet.profiles where name = p_profile) then
        perform fleet._raise('LF005', format('unknown profile %L', p_profile),
            'known profiles: ' || coalesce((select string_agg(name, ', ' order by name) from fleet.profiles), 'none')
            || '; profiles come from fleet.toml by `fleet lanes sync`');
    end if;

    insert into fleet.tasks (lane, key, title, payload, priority, run_at, max_attempts, tier, profile,
                             max_cost_usd, max_tokens)
    values (p_lane, p_key, p_title, coalesce(p_payload, '{}'), p_priority, coalesce(p_run_at, now()),
            p_max_attempts, fleet._tier_for(l, p_tier), p_profile, p_max_cost_usd, p_max_tokens)
    on conflict (key) do nothing
    returning id into v_id;

    if v_id is null then
        select t.id, t.lane into v_id, v_lane from fleet.tasks t where t.key = p_key;
        perform fleet._require_lane(v_lane);  -- the key's task may be in a lane this caller may not see
        return query select v_id, false;
        return;
    end if;
    perform fleet._event('enqueued', p_lane, v_id, null,
        jsonb_strip_nulls(jsonb_build_object('key', p_key, 'priority', p_priority,
            'run_at', coalesce(p_run_at, now()), 'tier', fleet._tier_for(l, p_tier), 'profile', p_profile)));
    return query select v_id, true;
end
$$;

comment on function fleet.enqueue_task is
    'enqueue, also saying whether the key was new (created) or already existed';

create function fleet.enqueue_after(
    p_delay_seconds double precision, p_lane text, p_key text, p_payload jsonb default '{}',
    p_priority int default 0, p_max_attempts int default null, p_title text default null,
    p_tier text default null, p_profile text default null, p_max_cost_usd numeric default null,
    p_max_tokens bigint default null)
returns table (task_id bigint, created boolean)
language sql
as $$
    select e.task_id, e.created
      from fleet.enqueue_task(p_lane, p_key, p_payload, p_priority,
                              now() + make_interval(secs => coalesce(p_delay_seconds, 0)),
                              p_max_attempts, p_title, p_tier, p_profile, p_max_cost_usd, p_max_tokens) e;
$$;

-- An operator's new budget for a task (e.g. before resuming one blocked by its budget). NULL
-- leaves that limit as it is; 0 removes it.
create or replace function fleet.set_task_budget(p_task bigint, p_max_cost_usd numeric default null,
                                                 p_max_tokens bigint default null)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
begin
    if p_max_cost_usd < 0 or p_max_tokens < 0 then
        perform fleet._raise('LF005', 'a task budget must not be negative');
    end if;
    t := fleet._lock_task(p_task);
    update fleet.tasks
       set max_cost_usd = case when p_max_cost_usd is null then max_cost_usd else nullif(p_max_cost_usd, 0) end,
           max_tokens = case when p_max_tokens is null then max_tokens else nullif(p_max_tokens, 0) end,
           updated_at = now()
     where id = p_task;
    perform fleet._event('budget_set', t.lane, p_task, null,
        jsonb_build_object('max_cost_usd', p_max_cost_usd, 'max_tokens', p_max_tokens,
                           'was', jsonb_build_object('max_cost_usd', t.max_cost_usd, 'max_tokens', t.max_tokens)));
    return t.state;
end
$$;

------------------------------------------------------------------------------------------------
-- claim: pools and profiles (see 20261130120000_fleet_dispatch.sql); the progress clock starts at
-- the claim; the review cap and the daily budget gate it

create or replace function fleet.claim(p_session uuid, p_limit int default 1)
returns setof fleet.tasks
language plpgsql
as $$
declare
    s fleet.sessions;
    l fleet.lanes;
    v_free int;
    v_avail jsonb := '{}';
    v_lane_cands jsonb;
    v_cands jsonb;
    v_choice jsonb;
    v_idx int;
    v_pool text;
    v_t fleet.tasks;
    v_c fleet.tasks;
    p record;
begin
    if p_limit is null or p_limit < 0 then
        perform fleet._raise('LF005', format('claim limit must be 0 or more, not %s', p_limit));
    end if;
    s := fleet._active_session(p_session);
    update fleet.sessions set heartbeat_at = now() where id = s.id;
    -- Serialise the claims of one lane: the running count below must not change under us, or two
    -- claimers could each take the last free slot. NO KEY UPDATE leaves enqueue's FK lock free.
    select * into l from fleet.lanes where name = s.lane for no key update;
    if l.paused or p_limit = 0 or now() >= s.deadline then
        return;
    end if;
    v_free := p_limit;
    if l.max_running is not null then
        v_free := least(p_limit,
            l.max_running - (select count(*) from fleet.tasks where lane = s.lane and state = 'running'));
    end if;
    if v_free <= 0 then
        return;
    end if;
    -- review debt: no claims while the lane's tasks waiting in review reach its review_cap
    if (l.config ->> 'review_cap') is not null
       and (select count(*) from fleet.tasks x where x.lane = s.lane and x.state = 'review')
           >= (l.config ->> 'review_cap')::int then
        return;
    end if;
    -- a lane over its daily budget claims nothing until the next UTC day
    if (l.config ->> 'daily_budget_usd') is not null or (l.config ->> 'daily_budget_tokens') is not null then
        if exists (select 1 from fleet._lane_spend_today(s.lane) sp
                    where sp.cost_usd >= (l.config ->> 'daily_budget_usd')::numeric
                       or sp.tokens >= (l.config ->> 'daily_budget_tokens')::numeric) then
            return;
        end if;
    end if;

    if not exists (select 1 from fleet.pools) then
        return query
        with ready as (
            -- the next ready tasks of the lane, skipping rows another transaction holds
            -- (not a task this session handed off itself: a hand-off is for the next shift)
            select t.id, t.priority, t.resume, t.run_at
              from fleet.tasks t
             where t.lane = s.lane and t.state = 'queued' and t.run_at <= now()
               and not (t.resume and exists (select 1 from fleet.runs r
                                              where r.task_id = t.id and r.session_id = s.id
                                                and r.outcome = 'handed_off'))
             order by t.priority desc, t.resume desc, t.run_at, t.id
             limit v_free
               for update skip locked
        ), claimed as (
            -- lease them to the session
            update fleet.tasks t
               set state = 'running',
                   attempts = t.attempts + 1,
                   lease_token = gen_random_uuid(),
                   lease_expires_at = now() + make_interval(secs => l.lease_seconds),
                   session_id = s.id,
                   resume = false,
                   last_progress_at = now(),
                   tier = fleet._tier_for(l, t.tier),
                   run_profile = coalesce(t.profile, l.config ->> 'profile'),
                   pool = null,
                   updated_at = now()
              from ready
             where t.id = ready.id
            returning t.*
        ), run_rows as (
            -- one run row per dispatch
            insert into fleet.runs (task_id, session_id, lane, attempt, lease_token, tier, profile)
            select c.id, s.id, c.lane, c.attempts, c.lease_token, c.tier, c.run_profile from claimed c
        ), journal as (
            insert into fleet.events (kind, lane, task_id, session_id, detail)
            select 'claimed', c.lane, c.id, s.id,
                   jsonb_strip_nulls(jsonb_build_object('attempt', c.attempts, 'tier', c.tier,
                                                        'profile', c.run_profile))
              from claimed c
        )
        -- in the order they were picked (the claim clears resume, so order by ready's copy of it)
        select c.* from claimed c join ready r on r.id = c.id
         order by r.priority desc, r.resume desc, r.run_at, r.id;
        return;
    end if;

    -- the free slots of every pool, counted under the pools' locks
    for p in select pl.name, pl.slots, pl.throttled_until from fleet.pools pl order by pl.name for no key update
    loop
        v_avail := v_avail || jsonb_build_object(p.name,
            case when p.throttled_until > now() then 0
                 when p.slots is null then 2147483647
                 else greatest(0, p.slots - (select count(*) from fleet.tasks x
                                              where x.state = 'running' and x.pool = p.name)) end);
    end loop;
    v_lane_cands := case when jsonb_typeof(l.config -> 'dispatch') = 'array'
                              and jsonb_array_length(l.config -> 'dispatch') > 0
                         then l.config -> 'dispatch'
                         else jsonb_build_array(jsonb_build_object(
                                  'pool', (select pf.pool from fleet.profiles pf where pf.name = l.config ->> 'profile'),
                                  'profile', l.config ->> 'profile')) end;

    for v_t in
        select * from fleet.tasks x
         where x.lane = s.lane and x.state = 'queued' and x.run_at <= now()
           and not (x.resume and exists (select 1 from fleet.runs r
                                          where r.task_id = x.id and r.session_id = s.id
                                            and r.outcome = 'handed_off'))
         order by x.priority desc, x.resume desc, x.run_at, x.id
         limit v_free * 10 + 50
           for update skip locked
    loop
        exit when v_free <= 0;
        v_cands := case when v_t.profile is not null
                        then jsonb_build_array(jsonb_build_object(
                                 'pool', (select pf.pool from fleet.profiles pf where pf.name = v_t.profile),
                                 'profile', v_t.profile))
                        else v_lane_cands end;
        v_choice := null;
        -- (a FOR loop's variable exists only inside the loop: keep the index in v_idx)
        for i in 0 .. jsonb_array_length(v_cands) - 1 loop
            if v_cands -> i ->> 'pool' is null or coalesce((v_avail ->> (v_cands -> i ->> 'pool'))::int, 0) > 0 then
                v_choice := v_cands -> i;
                v_idx := i;
                exit;
            end if;
        end loop;
        continue when v_choice is null;  -- every pool it may draw from is throttled or full
        v_pool := v_choice ->> 'pool';

        update fleet.tasks x
           set state = 'running',
               attempts = x.attempts + 1,
               lease_token = gen_random_uuid(),
               lease_expires_at = now() + make_interval(secs => l.lease_seconds),
               session_id = s.id,
               resume = false,
               last_progress_at = now(),
               tier = fleet._tier_for(l, x.tier),
               run_profile = v_choice ->> 'profile',
               pool = v_pool,
               updated_at = now()
         where x.id = v_t.id
        returning x.* into v_c;
        insert into fleet.runs (task_id, session_id, lane, attempt, lease_token, tier, profile, pool)
        values (v_c.id, s.id, v_c.lane, v_c.attempts, v_c.lease_token, v_c.tier, v_c.run_profile, v_c.pool);
        perform fleet._event('claimed', v_c.lane, v_c.id, s.id,
            jsonb_strip_nulls(jsonb_build_object('attempt', v_c.attempts, 'tier', v_c.tier,
                'profile', v_c.run_profile, 'pool', v_c.pool,
                -- drawn from a pool other than the lane's first choice, because that one was
                -- throttled or full
                'spilled', case when v_t.profile is null and v_idx > 0 then true end,
                'preferred_pool', case when v_t.profile is null and v_idx > 0
                                       then v_lane_cands -> 0 ->> 'pool' end)));
        if v_pool is not null then
            v_avail := jsonb_set(v_avail, array[v_pool], to_jsonb((v_avail ->> v_pool)::int - 1));
        end if;
        v_free := v_free - 1;
        return next v_c;
    end loop;
end
$$;

------------------------------------------------------------------------------------------------
-- heartbeat: progress, needs-attention, stalls

drop function fleet.heartbeat(uuid, bigint[]);

create function fleet.heartbeat(p_session uuid, p_tasks bigint[] default null,
                                p_progressed bigint[] default null, p_attention jsonb default null)
returns table (task_id bigint, status text)
language plpgsql
as $$
#variable_conflict use_column
declare
    s fleet.sessions;
    v_lease int;
    v_since timestamptz;
    v_task bigint;
    v_stalled bigint[] := '{}';
begin
    s := fleet._active_session(p_session);
    select lease_seconds into v_lease from fleet.lanes where name = s.lane;
    v_since := least(s.heartbeat_at, now()) - make_interval(secs => v_lease);
    update fleet.sessions set heartbeat_at = now() where id = s.id;

    if p_tasks is not null then
        for v_task in select t.id from fleet.tasks t
                       where t.session_id = s.id and t.state = 'running' and t.id <> all (p_tasks)
                       order by t.id
        loop
            perform fleet._release(v_task, 'not-run-by-shift');
        end loop;
    end if;

    -- progress the shift saw since its last heartbeat (checkpoint, log growth, agent hooks), and
    -- agents waiting on a question or a permission prompt ({"<task id>": "what it waits for"})
    if p_progressed is not null then
        update fleet.tasks t set last_progress_at = now()
         where t.session_id = s.id and t.state = 'running' and t.id = any (p_progressed);
    end if;
    if p_attention is not null and jsonb_typeof(p_attention) = 'object' then
        update fleet.tasks t
           set attention = left(p_attention ->> t.id::text, 500),
               attention_at = case when p_attention ? t.id::text
                                   then coalesce(case when t.attention is not null then t.attention_at end, now()) end
         where t.session_id = s.id and t.state = 'running'
           and (p_attention ? t.id::text or t.attention is not null);
    end if;
    -- stalls: alive but no progress for the lane's stall_seconds; where the lane says so
    -- (stall_action = stop) the attempt fails with reason stalled (escalating) and the shift is
    -- told to stop the agent
    for v_task in
        select t.id from fleet.tasks t join fleet.lanes l on l.name = t.lane
         where t.session_id = s.id and t.state = 'running'
           and l.config ->> 'stall_action' = 'stop' and (l.config ->> 'stall_seconds') is not null
           and (p_tasks is null or t.id = any (p_tasks))
           and coalesce(t.last_progress_at, now())
               < now() - make_interval(secs => (l.config ->> 'stall_seconds')::double precision)
           and t.attention is null  -- waiting on a human is not a stall
         order by t.id
    loop
        perform fleet.fail(v_task, (select lease_token from fleet.tasks where id = v_task),
            format('stalled: no progress for %s s (no checkpoint, no output, no hook)',
                   (select l.config ->> 'stall_seconds' from fleet.tasks t join fleet.lanes l on l.name = t.lane
                     where t.id = v_task)),
            true, 'stalled');
        v_stalled := v_stalled || v_task;
    end loop;

    return query select x, 'stalled'::text from unnest(v_stalled) x;
    return query
    with renewed as (
        update fleet.tasks t
           set lease_expires_at = now() + make_interval(secs => l.lease_seconds),
               updated_at = now()
          from fleet.lanes l
         where t.session_id = s.id and t.state = 'running' and l.name = t.lane
           and (p_tasks is null or t.id = any (p_tasks))
        returning t.id
    )
    select r.id, 'ok'::text from renewed r
    union all
    (select distinct on (r.task_id) r.task_id,
            case r.outcome when 'cancelled' then 'cancelled' else 'lost' end
       from fleet.runs r
      where r.session_id = s.id
        and r.task_id not in (select id from renewed)
        and r.task_id <> all (v_stalled)
        and case when p_tasks is null
                 then r.outcome in ('lost', 'cancelled') and r.ended_at >= v_since
                 else r.task_id = any (p_tasks) end
      -- one row per task: the outcome of its latest run in this session
      order by r.task_id, r.id desc);
end
$$;

-- What the monitor reports each pass: running tasks without progress for their lane's
-- stall_seconds (liveness is not progress), and agents waiting on a prompt. Read only.
create or replace function fleet.stalled_tasks()
returns table (task_id bigint, lane text, session_id uuid, key text, quiet_seconds numeric,
               stall_seconds int, stall_action text, attention text)
language sql
stable
as $$
    select t.id, t.lane, t.session_id, t.key,
           round(extract(epoch from now() - t.last_progress_at)::numeric, 1),
           (l.config ->> 'stall_seconds')::int, coalesce(l.config ->> 'stall_action', 'report'), t.attention
      from fleet.tasks t
      join fleet.lanes l on l.name = t.lane
     where t.state = 'running' and fleet._lane_allowed(t.lane)
       and (t.attention is not null
            or ((l.config ->> 'stall_seconds') is not null
                and t.last_progress_at < now() - make_interval(secs => (l.config ->> 'stall_seconds')::double precision)))
     order by t.id;
$$;

------------------------------------------------------------------------------------------------
-- complete: into review where the lane requires one

create or replace function fleet.complete(p_task bigint, p_token uuid, p_result jsonb default null)
returns text
language plpgsql
as $$
declare
    t fleet.tasks;
    v_state text;
begin
    t := fleet._fenced(p_task, p_token);
    v_state := fleet._done_state(t.lane);
    update fleet.tasks
       set state = v_state, result = p_result, updated_at = now(),
           finished_at = case when v_state = 'done' then now() end,
           attention = null, attention_at = null,
           lease_token = null, lease_expires_at = null, session_id = null
     where id = p_task;
    perform fleet._end_run(p_token, 'done');
    perform fleet._event('completed', t.lane, p_task, t.session_id,
        jsonb_build_object('attempt', t.attempts, 'state', v_state));
    return v_state;
end
$$;

-- complete_many (20261130110000_fleet_bulk.sql) likewise: a review lane's tasks go to review

create or replace function fleet.complete_many(p_tasks bigint[], p_tokens uuid[], p_results jsonb[] default null)
returns table (task_id bigint, status text)
language plpgsql
as $$
#variable_conflict use_column
declare
    v_n int := coalesce(cardinality(p_tasks), 0);
    v_lanes text[];
    v_lane text;
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

    -- lock every named task, in id order; the lane check of each before anything is written
    select array_agg(distinct l.lane) into v_lanes
      from (select t.lane from fleet.tasks t where t.id = any (p_tasks) order by t.id for no key update) l;
    foreach v_lane in array coalesce(v_lanes, '{}') loop
        perform fleet._require_lane(v_lane);
    end loop;

    return query
    with item as (
        select u.task_id, u.token, u.result, u.ord
          from unnest(p_tasks, p_tokens, coalesce(p_results, array_fill(null::jsonb, array[v_n])))
               with ordinality as u(task_id, token, result, ord)
    ), held as (
        -- the tasks whose lease the given token still holds (read before the update below: the
        -- session and attempt the journal names)
        select t.id, t.lane, t.session_id, t.attempts, i.token, i.result
          from fleet.tasks t
          join item i on i.task_id = t.id
         where t.state = 'running' and i.token is not null and t.lease_token = i.token
    ), done as (
        -- into review where the lane requires one (fleet._done_state), as fleet.complete does
        update fleet.tasks t
           set state = fleet._done_state(h.lane), result = h.result, updated_at = now(),
               finished_at = case when fleet._done_state(h.lane) = 'done' then now() end,
               attention = null, attention_at = null,
               lease_token = null, lease_expires_at = null, session_id = null
          from held h
         where t.id = h.id and t.state = 'running' and t.lease_token = h.token
        returning t.id, t.state
    ), closed as (
        -- the run of each lease (fleet._end_run)
        update fleet.runs r
           set outcome = 'done', ended_at = now()
          from held h
         where r.lease_token = h.token and r.ended_at is null
    ), journal as (
        insert into fleet.events (kind, lane, task_id, session_id, detail)
        select 'completed', h.lane, h.id, h.session_id,
               jsonb_build_object('attempt', h.attempts, 'state', fleet._done_state(h.lane))
          from held h
         order by h.id
    )
    select i.task_id,
           case when d.id is not null then d.state
                when exists (select 1 from fleet.tasks t where t.id = i.task_id) then 'lost'
                else 'unknown' end
      from item i
      left join done d on d.id = i.task_id
     order by i.ord;
end
$$;

------------------------------------------------------------------------------------------------
-- review

create or replace function fleet.review_approve(p_task bigint, p_note text default null)
returns text
language plpgsql
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

-- Back to the queue with the reviewer's note, which the next attempt's prompt carries. A rejection
-- is not a failed attempt (the agent did finish), so it spends nothing of the attempt cap.
create or replace function fleet.review_reject(p_task bigint, p_note text)
returns text
language plpgsql
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

------------------------------------------------------------------------------------------------
-- views

create or replace view fleet.lane_overview as
with outcomes as (
    -- the journal's last 24 h of outcomes per lane (events_kind_ts: one range per kind)
    select e.lane,
           count(*) filter (where e.kind = 'completed') as done_24h,
           count(*) filter (where e.kind = 'failed') as failed_24h,
           count(*) filter (where e.kind in ('failed', 'repaired', 'handed_off')
                              and e.detail ->> 'state' = 'dead') as dead_24h,
           count(*) filter (where e.kind = 'cancelled') as cancelled_24h,
           count(*) filter (where e.kind in ('failed', 'repaired')
                              and e.detail ->> 'state' = 'queued') as retries_24h,
           count(*) filter (where e.kind = 'handed_off') as handoffs_24h,
           count(*) filter (where e.kind = 'repaired') as repairs_24h,
           count(*) filter (where e.kind = 'retried') as operator_retries_24h
      from fleet.events e
     where e.kind in ('completed', 'failed', 'repaired', 'handed_off', 'cancelled', 'retried')
       and e.ts >= now() - interval '24 hours'
     group by e.lane
)
select l.name as lane,
       l.paused,
       q.queued,
       q.ready,
       q.queued - q.ready as scheduled,
       r.running,
       l.max_running as slots,
       case when l.max_running is not null then greatest(l.max_running - r.running, 0) end as idle_slots,
       round(extract(epoch from now() - q.oldest_ready_at), 1) as oldest_ready_seconds,
       coalesce(o.done_24h, 0) as done_24h,
       coalesce(o.failed_24h, 0) as failed_24h,
       coalesce(o.dead_24h, 0) as dead_24h,
       coalesce(o.cancelled_24h, 0) as cancelled_24h,
       coalesce(o.retries_24h, 0) as retries_24h,
       coalesce(o.handoffs_24h, 0) as handoffs_24h,
       coalesce(o.repairs_24h, 0) as repairs_24h,
       coalesce(o.operator_retries_24h, 0) as operator_retries_24h,
       s.active_sessions,
       h.created_at as last_handoff_at,
       g.blocked,
       g.in_review,
       (l.config ->> 'review_cap')::int as review_cap,
       g.needs_attention,
       sp.cost_usd as spent_today_usd,
       sp.tokens as spent_today_tokens,
       (l.config ->> 'daily_budget_usd')::numeric as daily_budget_usd,
       (l.config ->> 'daily_budget_tokens')::numeric as daily_budget_tokens,
       coalesce(sp.cost_usd >= (l.config ->> 'daily_budget_usd')::numeric, false)
           or coalesce(sp.tokens >= (l.config ->> 'daily_budget_tokens')::numeric, false) as over_budget
  from fleet.lanes l
  -- queued rows of the lane: tasks_ready (partial, queued only)
  cross join lateral (
        select count(*) as queued,
               count(*) filter (where t.run_at <= now()) as ready,
               min(t.run_at) filter (where t.run_at <= now()) as oldest_ready_at
          from fleet.tasks t
         where t.lane = l.name and t.state = 'queued') q
  -- running rows of the lane: tasks_running_lane (partial, running only)
  cross join lateral (
        select count(*) as running from fleet.tasks t where t.lane = l.name and t.state = 'running') r
  cross join lateral (
        select count(*) as active_sessions
          from fleet.sessions s where s.lane = l.name and s.state = 'active') s
  left join lateral (
        select h.created_at from fleet.lane_handoffs h where h.lane = l.name order by h.id desc limit 1) h
    on true
  left join outcomes o on o.lane = l.name
  -- waiting for people: blocked (tasks_blocked), in review (tasks_review), agents waiting on a prompt
  cross join lateral (
        select count(*) filter (where t.state = 'blocked') as blocked,
               count(*) filter (where t.state = 'review') as in_review,
               count(*) filter (where t.state = 'running' and t.attention is not null) as needs_attention
          from fleet.tasks t
         where t.lane = l.name and t.state in ('blocked', 'review', 'running')) g
  cross join lateral fleet._lane_spend_today(l.name) sp
 order by l.name;

comment on column fleet.lane_overview.blocked is 'tasks blocked until an operator acts (fleet resume / retry)';
comment on column fleet.lane_overview.in_review is 'completed tasks waiting for review (fleet review approve|reject)';
comment on column fleet.lane_overview.needs_attention is 'running agents waiting on a question or a permission prompt';
comment on column fleet.lane_overview.over_budget is 'the lane spent its daily budget: no claims until the next UTC day';

create view fleet.review_queue as
select t.id, t.lane, t.key, t.title, t.tier, t.run_profile as profile, t.pool, t.updated_at as since,
       left(t.result ->> 'summary', 500) as summary
  from fleet.tasks t
 where t.state = 'review';

comment on view fleet.review_queue is 'Completed tasks waiting for review, per lane (fleet review list).';

-- Review outcomes of the last 30 days by lane, pool and host (the host of the shift whose run
-- completed the task): approved, rejected, accept rate = approved / (approved + rejected).
create view fleet.review_accept_rate as
select e.lane,
       e.detail ->> 'pool' as pool,
       e.detail ->> 'host' as host,
       count(*) filter (where e.kind = 'review_approved') as approved,
       count(*) filter (where e.kind = 'review_rejected') as rejected,
       round(count(*) filter (where e.kind = 'review_approved')::numeric / nullif(count(*), 0), 3) as accept_rate
  from fleet.events e
 where e.kind in ('review_approved', 'review_rejected') and e.ts >= now() - interval '30 days'
 group by e.lane, e.detail ->> 'pool', e.detail ->> 'host';

comment on view fleet.review_accept_rate is
    'Review outcomes of 30 days per lane, pool and host: approved / (approved + rejected).';

create view fleet.attention_tasks as
select t.id, t.lane, t.key, t.attention, t.attention_at, s.host, s.pid
  from fleet.tasks t
  join fleet.sessions s on s.id = t.session_id
 where t.state = 'running' and t.attention is not null;

comment on view fleet.attention_tasks is
    'Running agents waiting on a question or a permission prompt: needs-attention, not progress.';


-- the columns of the views above (every view and column is documented)
comment on column fleet.lane_overview.review_cap is 'the lane''s review_cap: no claims while this many tasks wait in review (NULL: no cap)';
comment on column fleet.lane_overview.spent_today_usd is 'cost of the lane''s runs started since midnight UTC';
comment on column fleet.lane_overview.spent_today_tokens is 'tokens (every kind) of the lane''s runs started since midnight UTC';
comment on column fleet.lane_overview.daily_budget_usd is 'the lane''s daily cost budget (NULL: none)';
comment on column fleet.lane_overview.daily_budget_tokens is 'the lane''s daily token budget (NULL: none)';
comment on column fleet.pool_overview.pool is 'the capacity pool';
comment on column fleet.pool_overview.slots is 'agents at once across the fleet (NULL: unlimited)';
comment on column fleet.pool_overview.in_use is 'running tasks drawing from the pool';
comment on column fleet.pool_overview.throttled_until is 'a usage limit: no claims from the pool before this (NULL: not throttled)';
comment on column fleet.pool_overview.throttle_note is 'the message that throttled it';
comment on column fleet.pool_overview.throttles_today is 'usage limits hit since midnight UTC';
comment on column fleet.pool_overview.spillovers_today is 'claims since midnight UTC that came here because the lane''s first pool was throttled or full';
comment on column fleet.pool_overview.profiles is 'the profiles drawing from the pool';
comment on column fleet.pool_accept_rate.pool is 'the capacity pool';
comment on column fleet.pool_accept_rate.day is 'the UTC day the runs started';
comment on column fleet.pool_accept_rate.runs is 'runs that drew from the pool';
comment on column fleet.pool_accept_rate.done is 'runs that completed';
comment on column fleet.pool_accept_rate.failed is 'runs that failed (or went to the dead letter)';
comment on column fleet.pool_accept_rate.blocked is 'runs whose task was blocked (gate could not judge, budget)';
comment on column fleet.pool_accept_rate.throttled is 'runs that hit a usage limit';
comment on column fleet.pool_accept_rate.accept_rate is 'done / (done + failed + blocked)';
comment on column fleet.blocked_tasks.id is 'the task';
comment on column fleet.blocked_tasks.lane is 'its lane';
comment on column fleet.blocked_tasks.key is 'its key';
comment on column fleet.blocked_tasks.title is 'its title';
comment on column fleet.blocked_tasks.block_reason is 'automation-broken, capability-unavailable (its verify gate) or budget';
comment on column fleet.blocked_tasks.tier is 'the tier of its next attempt';
comment on column fleet.blocked_tasks.profile is 'the profile of its last attempt';
comment on column fleet.blocked_tasks.blocked_at is 'when it was blocked';
comment on column fleet.blocked_tasks.evidence is 'the gate''s output tail or the budget it spent';
comment on column fleet.review_queue.id is 'the task';
comment on column fleet.review_queue.lane is 'its lane';
comment on column fleet.review_queue.key is 'its key';
comment on column fleet.review_queue.title is 'its title';
comment on column fleet.review_queue.tier is 'the tier it ran at';
comment on column fleet.review_queue.profile is 'the profile it ran with';
comment on column fleet.review_queue.pool is 'the pool it drew from';
comment on column fleet.review_queue.since is 'when it went to review';
comment on column fleet.review_queue.summary is 'the agent''s final message (its result summary)';
comment on column fleet.review_accept_rate.lane is 'the lane';
comment on column fleet.review_accept_rate.pool is 'the pool the completing run drew from';
comment on column fleet.review_accept_rate.host is 'the host of the completing run''s shift';
comment on column fleet.review_accept_rate.approved is 'reviews approved in 30 days';
comment on column fleet.review_accept_rate.rejected is 'reviews rejected in 30 days';
comment on column fleet.review_accept_rate.accept_rate is 'approved / (approved + rejected)';
comment on column fleet.attention_tasks.id is 'the task';
comment on column fleet.attention_tasks.lane is 'its lane';
comment on column fleet.attention_tasks.key is 'its key';
comment on column fleet.attention_tasks.attention is 'what its agent waits for';
comment on column fleet.attention_tasks.attention_at is 'since when';
comment on column fleet.attention_tasks.host is 'the host of its shift';
comment on column fleet.attention_tasks.pid is 'the pid of its shift';

------------------------------------------------------------------------------------------------
-- security

do $$
declare
    f regprocedure;
begin
    for f in
        select p.oid::regprocedure
          from pg_catalog.pg_proc p
          join pg_catalog.pg_namespace n on n.oid = p.pronamespace
         where n.nspname = 'fleet'
           and p.proname in ('enqueue_task', 'enqueue_after', 'claim', 'heartbeat', 'complete', 'task_spend',
                             'set_task_budget', 'review_approve', 'review_reject', 'stalled_tasks',
                             'complete_many')
         order by p.oid
    loop
        execute format('alter function %s security definer set search_path = pg_catalog, fleet, pg_temp', f);
    end loop;
end
$$;

revoke execute on function fleet._done_state, fleet._lane_spend_today, fleet.task_spend, fleet.enqueue_task,
    fleet.enqueue_after, fleet.set_task_budget, fleet.heartbeat, fleet.review_approve, fleet.review_reject,
    fleet.stalled_tasks
    from public;
grant execute on function fleet._done_state, fleet._lane_spend_today, fleet.task_spend, fleet.enqueue_task,
    fleet.enqueue_after, fleet.set_task_budget, fleet.heartbeat, fleet.review_approve, fleet.review_reject,
    fleet.stalled_tasks
    to service_role;
grant execute on function fleet.task_spend, fleet.enqueue_task, fleet.enqueue_after, fleet.heartbeat
    to fleet_worker;
grant execute on function fleet.task_spend, fleet.enqueue_task, fleet.enqueue_after, fleet.set_task_budget,
    fleet.review_approve, fleet.review_reject, fleet._lane_spend_today, fleet.stalled_tasks
    to fleet_operator;
grant select on fleet.lane_overview, fleet.review_queue, fleet.review_accept_rate, fleet.attention_tasks
    to fleet_operator;

notify pgrst, 'reload schema';
