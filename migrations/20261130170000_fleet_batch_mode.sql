-- lanefleet: batch mode, cheaper (issue #7; bench/README.md, "Batch mode: complete_many by key,
-- large claims side by side").
--
-- 1. fleet.complete_many reads and writes each task by its key. The version of
--    20261130130000_fleet_guardrails.sql joined its common table expressions to one another.
--    PostgreSQL estimates a CTE that reads the running tasks at one row (few tasks run), so the
--    update of the tasks and the close of the runs were nested loops that compared every running
--    task (every open run) of the fleet with every named task: a batch of 100 compared 10,000
--    pairs, and the cost grew with the fleet's running work. _done_state was also called three
--    times per task. Now the held tasks are read once into arrays (after the same lock, in id
--    order), and each write joins those arrays to its table by key: tasks by id, runs by lease
--    token. The done state is read once per lane. Same signature, same answers (done | review |
--    lost | unknown per element, in input order), same refusals (LF005, LF008) with nothing
--    changed, same lock order. 136 -> 54 µs per task (a claim of 100 and a complete_many of 100,
--    20,000 tasks, one client).
-- 2. Large claims no longer take turns. 20261130160000_fleet_fast_paths.sql made a claim of more
--    than 32 tasks hold a second per-lane advisory key until its commit, because 16 claimers of
--    100 scanning past each other's uncommitted rows cost more than waiting. With complete_many
--    cheap, the claim is most of a batch's time and waiting for the turn dominated (Lock:advisory
--    86 % of the waits at concurrency 16): without it batch mode at concurrency 4 and 16 is 20-25 %
--    faster. fleet.claim is otherwise as in 20261130160000.

create or replace function fleet.claim(p_session uuid, p_limit int default 1)
returns setof fleet.tasks
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
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
    -- The lane's settings do not change under a claim: fleet.sync_lane takes this key exclusively
    -- before it writes the lane, so it waits for the claims in flight, and the claims after it
    -- read what it wrote. Claims take it shared: they never wait for each other here.
    perform pg_catalog.pg_advisory_xact_lock_shared(736610438, pg_catalog.hashtext(s.lane));
    select * into l from fleet.lanes where name = s.lane;
    -- Serialise the claims of a lane with a limit counted across claims (max_running, review_cap,
    -- a daily budget): the counts below must not change under us, or two claimers could each take
    -- the last free slot. NO KEY UPDATE leaves enqueue's FK lock free. A lane without such a limit
    -- takes no lane lock, so its claims run side by side: FOR UPDATE SKIP LOCKED keeps them off
    -- each other's tasks, and pools count their slots under the pools' own locks (below).
    if l.max_running is not null or (l.config ->> 'review_cap') is not null
       or (l.config ->> 'daily_budget_usd') is not null or (l.config ->> 'daily_budget_tokens') is not null then
        select * into l from fleet.lanes where name = s.lane for no key update;
    end if;
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

create or replace function fleet.complete_many(p_tasks bigint[], p_tokens uuid[], p_results jsonb[] default null)
returns table (task_id bigint, status text)
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
#variable_conflict use_column
declare
    v_n int := coalesce(cardinality(p_tasks), 0);
    v_lanes text[];
    v_lane_done text[];
    v_dup bigint;
    v_ids bigint[];
    v_tokens uuid[];
    v_results jsonb[];
    v_states text[];
    v_task_lanes text[];
    v_sessions uuid[];
    v_attempts int[];
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

    -- lock every named task, in id order; the lane check of each lane before anything is written,
    -- and what a completed task of that lane becomes (review or done), once per lane
    select array_agg(distinct l.lane) into v_lanes
      from (select t.lane from fleet.tasks t where t.id = any (p_tasks) order by t.id for no key update) l;
    v_lanes := coalesce(v_lanes, '{}');
    for i in 1 .. cardinality(v_lanes) loop
        perform fleet._require_lane(v_lanes[i]);
        v_lane_done[i] := fleet._done_state(v_lanes[i]);
    end loop;

    -- the tasks whose lease the given token still holds, read before they are written (the
    -- session and attempt the journal names), in id order
    select array_agg(t.id order by t.id), array_agg(i.token order by t.id), array_agg(i.result order by t.id),
           array_agg(v_lane_done[array_position(v_lanes, t.lane)] order by t.id),
           array_agg(t.lane order by t.id), array_agg(t.session_id order by t.id),
           array_agg(t.attempts order by t.id)
      into v_ids, v_tokens, v_results, v_states, v_task_lanes, v_sessions, v_attempts
      from unnest(p_tasks, p_tokens, coalesce(p_results, array_fill(null::jsonb, array[v_n])))
           as i(task_id, token, result)
      join fleet.tasks t on t.id = i.task_id
     where t.state = 'running' and i.token is not null and t.lease_token = i.token;

    if v_ids is not null then
        update fleet.tasks t
           set state = h.state, result = h.result, updated_at = now(),
               finished_at = case when h.state = 'done' then now() end,
               attention = null, attention_at = null,
               lease_token = null, lease_expires_at = null, session_id = null
          from unnest(v_ids, v_results, v_states) as h(id, result, state)
         where t.id = h.id;
        -- the run of each lease (fleet._end_run)
        update fleet.runs r
           set outcome = 'done', ended_at = now()
          from unnest(v_tokens) as h(token)
         where r.lease_token = h.token and r.ended_at is null;
        insert into fleet.events (kind, lane, task_id, session_id, detail)
        select 'completed', h.lane, h.id, h.session_id, jsonb_build_object('attempt', h.attempts, 'state', h.state)
          from unnest(v_ids, v_task_lanes, v_sessions, v_attempts, v_states) as h(id, lane, session_id, attempts, state);
    end if;

    return query
    select i.task_id,
           case when h.ord is not null then v_states[h.ord]
                when exists (select 1 from fleet.tasks t where t.id = i.task_id) then 'lost'
                else 'unknown' end
      from unnest(p_tasks) with ordinality as i(task_id, ord)
      left join unnest(v_ids) with ordinality as h(id, ord) on h.id = i.task_id
     order by i.ord;
end
$$;

comment on function fleet.complete_many(bigint[], uuid[], jsonb[]) is
    'Complete many running tasks in one transaction, each fenced by its own lease token as '
    'fleet.complete fences it: (task_id, status) per element in input order, status done | review | '
    'lost | unknown. Refused with nothing changed: arrays of different lengths, a NULL or repeated '
    'task id (LF005), a task of a lane the caller may not work (LF008).';

notify pgrst, 'reload schema';
