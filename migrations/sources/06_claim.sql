-- The claim: ready tasks of a session's lane under a lease, within every limit.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

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
    v_over text;
    p record;
    v_room jsonb := '{}';
    v_exp_tok numeric;
    v_exp_usd numeric;
    v_short boolean;
    v_short_pools text[];
    v_reopens timestamptz;
    v_ids bigint[];
begin
    if p_limit is null or p_limit < 0 then
        perform fleet._raise('LF005', format('claim limit must be 0 or more, not %s', p_limit));
    end if;
    -- the session's heartbeat, which locks it; refused as fleet._active_session refuses when
    -- there is no such active session of the caller's lanes
    update fleet.sessions set heartbeat_at = now()
     where id = p_session and state = 'active' and fleet._lane_allowed(lane)
    returning * into s;
    if not found then
        s := fleet._active_session(p_session);
    end if;
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
    -- paused (by the operator, or by lanefleet for a config it found wrong) or retired: nothing
    if not fleet._lane_claimable(l) or p_limit = 0 or now() >= s.deadline then
        return;
    end if;
    v_free := p_limit;
    if l.max_running is not null then
        v_free := least(p_limit,  -- (tasks_live_lane)
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
        -- the next ready tasks of the lane, locked, skipping rows another transaction holds (not a
        -- task this session handed off itself: a hand-off is for the next shift), in claim order
        v_ids := array(
            select t.id
              from fleet.tasks t
             where t.lane = s.lane and t.state = 'queued' and t.run_at <= now()
               and not (t.carry_over and exists (select 1 from fleet.runs r
                                              where r.task_id = t.id and r.session_id = s.id
                                                and r.outcome = 'handed_off'))
             order by t.priority desc, t.carry_over desc, t.run_at, t.id
             limit v_free
               for update skip locked);
        -- (two statements, not one: the update below, by an array of ids, has one plan for every
        -- claim, where the row count of a LIMIT made the planner plan the whole statement anew
        -- for each call, and a plan made for any LIMIT joined the tasks by a sequential scan)
        for v_c in
        with claimed as (
            -- lease them to the session
            update fleet.tasks t
               set state = 'running',
                   attempts = t.attempts + 1,
                   lease_token = gen_random_uuid(),
                   lease_expires_at = now() + make_interval(secs => l.lease_seconds),
                   session_id = s.id,
                   carry_over = false,
                   last_progress_at = now(),
                   tier = fleet._tier_for(l, t.tier),
                   run_profile = coalesce(t.profile, l.config ->> 'profile'),
                   pool = null,
                   updated_at = now()
             where t.id = any (v_ids)
            returning t.*
        ), run_rows as (
            -- one run row per dispatch: the claim's entry in the journal (fleet.journal), its
            -- ids in claim order
            insert into fleet.runs (task_id, session_id, lane, attempt, lease_token, tier, profile)
            select c.id, s.id, c.lane, c.attempts, c.lease_token, c.tier, c.run_profile
              from claimed c join unnest(v_ids) with ordinality as o(id, ord) on o.id = c.id
             order by o.ord
        )
        -- in the order they were picked
        select c.* from claimed c join unnest(v_ids) with ordinality as o(id, ord) on o.id = c.id
         order by o.ord
        loop
            v_over := fleet._over_budget(v_c, l);
            if v_over is null then
                return next v_c;
            else  -- its earlier runs spent its budget: blocked here, never run into more spend
                perform fleet.block(v_c.id, v_c.lease_token, 'budget', v_over);
            end if;
        end loop;
        return;
    end if;

    -- the free slots of every pool, counted under the pools' locks
    for p in select pl.name, pl.slots, pl.throttled_until, pl.windows from fleet.pools pl order by pl.name
                for no key update
    loop
        -- and the room left in its usage windows (fleet._window_room), for the look-ahead below
        if p.windows <> '{}' then
            v_room := v_room || jsonb_build_object(p.name, fleet._window_room(p.name));
        end if;
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
           and not (x.carry_over and exists (select 1 from fleet.runs r
                                          where r.task_id = x.id and r.session_id = s.id
                                            and r.outcome = 'handed_off'))
         order by x.priority desc, x.carry_over desc, x.run_at, x.id
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
        v_short := false;
        v_short_pools := '{}';
        v_reopens := null;
        -- what it is expected to spend, where a pool it may draw from has usage windows: the lane's
        -- recent median per task of its tier, else its own budget
        if v_room <> '{}' then
            select coalesce(e.tokens, v_t.max_tokens), coalesce(e.usd, v_t.max_cost_usd)
              into v_exp_tok, v_exp_usd
              from fleet._expected_cost(s.lane, fleet._tier_for(l, v_t.tier)) e;
        end if;
        -- (a FOR loop's variable exists only inside the loop: keep the index in v_idx)
        for i in 0 .. jsonb_array_length(v_cands) - 1 loop
            v_pool := v_cands -> i ->> 'pool';
            if v_pool is not null and coalesce((v_avail ->> v_pool)::int, 0) > 0 and v_room ? v_pool
               and not fleet._window_fits(v_room -> v_pool, v_exp_tok, v_exp_usd) then
                -- its windows have no room for it: the next pool, before this one throttles
                v_short := true;
                v_short_pools := v_short_pools || v_pool;
                v_reopens := greatest(v_reopens, fleet._window_reopens(v_room -> v_pool, v_exp_tok, v_exp_usd));
                continue;
            end if;
            if v_pool is null or coalesce((v_avail ->> v_pool)::int, 0) > 0 then
                v_choice := v_cands -> i;
                v_idx := i;
                exit;
            end if;
        end loop;
        if v_choice is null and v_short then
            -- no pool it may draw from has room in its windows: it waits for the first to reopen
            update fleet.tasks x set run_at = coalesce(v_reopens, now() + interval '5 minutes'), updated_at = now()
             where x.id = v_t.id;
            perform fleet._event('window_deferred', v_t.lane, v_t.id, s.id, jsonb_build_object(
                'until', coalesce(v_reopens, now() + interval '5 minutes'), 'pools', to_jsonb(v_short_pools),
                'expected_tokens', v_exp_tok, 'expected_usd', v_exp_usd));
        end if;
        continue when v_choice is null;  -- every pool it may draw from is throttled, full or out of room
        v_pool := v_choice ->> 'pool';
        if v_room ? v_pool then
            v_room := jsonb_set(v_room, array[v_pool], fleet._window_take(v_room -> v_pool, v_exp_tok, v_exp_usd));
        end if;

        update fleet.tasks x
           set state = 'running',
               attempts = x.attempts + 1,
               lease_token = gen_random_uuid(),
               lease_expires_at = now() + make_interval(secs => l.lease_seconds),
               session_id = s.id,
               carry_over = false,
               last_progress_at = now(),
               tier = fleet._tier_for(l, x.tier),
               run_profile = v_choice ->> 'profile',
               pool = v_pool,
               updated_at = now()
         where x.id = v_t.id
        returning x.* into v_c;
        -- its run: the claim's entry in the journal (fleet.journal), with how the pool was chosen
        insert into fleet.runs (task_id, session_id, lane, attempt, lease_token, tier, profile, pool, claim_detail)
        values (v_c.id, s.id, v_c.lane, v_c.attempts, v_c.lease_token, v_c.tier, v_c.run_profile, v_c.pool,
                nullif(jsonb_strip_nulls(jsonb_build_object(
                    -- drawn from a pool other than the lane's first choice, because that one was
                    -- throttled or full
                    'spilled', case when v_t.profile is null and v_idx > 0 then true end,
                    'preferred_pool', case when v_t.profile is null and v_idx > 0
                                           then v_lane_cands -> 0 ->> 'pool' end,
                    -- a pool passed over because its usage windows had no room (a throttle avoided)
                    'window_spill', case when v_short then to_jsonb(v_short_pools) end)), '{}'));
        v_over := fleet._over_budget(v_c, l);
        if v_over is not null then  -- as above: blocked, and it takes no slot of the pool
            perform fleet.block(v_c.id, v_c.lease_token, 'budget', v_over);
            continue;
        end if;
        if v_pool is not null then
            v_avail := jsonb_set(v_avail, array[v_pool], to_jsonb((v_avail ->> v_pool)::int - 1));
        end if;
        v_free := v_free - 1;
        return next v_c;
    end loop;
end
$$;
revoke all on function fleet.claim(uuid,integer) from public;
grant execute on function fleet.claim(uuid,integer) to fleet_worker, service_role;

-- The tasks a session holds that its shift does not know of. A claim whose answer was lost on the
-- way (the connection broke after its commit, a request timed out after the server answered) made
-- them the session's and the shift never heard: its next heartbeat, which names the tasks it
-- runs, would release them as not-run-by-shift and spend an attempt on work that never ran. A
-- shift whose claim failed so asks this first, and starts what it finds as the claim would have.
-- p_known: the tasks the shift knows (it runs them, holds them, or has final calls pending for
-- them). Rows: the tasks as fleet.claim returned them (their lease, attempt, tier and pool), in
-- id order. Refused as fleet._active_session refuses (LF006) when the session is not active or
-- not of the caller's lanes. It writes nothing: the claim made the runs and renewed the session.
create or replace function fleet.claimed(p_session uuid, p_known bigint[] default '{}')
returns setof fleet.tasks
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
declare
    s fleet.sessions;
begin
    s := fleet._active_session(p_session);
    return query
        select * from fleet.tasks t
         where t.session_id = s.id and t.state = 'running'
           and t.id <> all (coalesce(p_known, '{}'))
         order by t.id;
end
$$;
revoke all on function fleet.claimed(uuid,bigint[]) from public;
grant execute on function fleet.claimed(uuid,bigint[]) to fleet_worker, service_role;

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
revoke all on function fleet._lane_spend_today(text) from public;
grant execute on function fleet._lane_spend_today(text) to fleet_operator, service_role;

-- Why a task just claimed may not run: its earlier runs spent its budget (its own, else its
-- lane's max_cost_usd / max_tokens as synced). NULL when it may run.
create or replace function fleet._over_budget(t fleet.tasks, l fleet.lanes)
returns text
language plpgsql
stable
as $$
declare
    v_cost numeric := coalesce(t.max_cost_usd, (l.config ->> 'max_cost_usd')::numeric);
    v_tokens numeric := coalesce(t.max_tokens, (l.config ->> 'max_tokens')::numeric);
    v_spent_cost numeric;
    v_spent_tokens numeric;
begin
    if v_cost is null and v_tokens is null then
        return null;
    end if;
    select coalesce(sum(r.cost_usd), 0),
           coalesce(sum(r.input_tokens + r.cache_creation_tokens + r.cache_read_tokens + r.output_tokens), 0)
      into v_spent_cost, v_spent_tokens
      from fleet.runs r where r.task_id = t.id;
    if v_spent_cost >= v_cost then
        return format('spent $%s of the task''s $%s budget (%s tokens)', to_char(v_spent_cost, 'FM999999990.0000'),
                      to_char(v_cost, 'FM999999990.0000'), to_char(v_spent_tokens, 'FM999,999,999,999,990'));
    elsif v_spent_tokens >= v_tokens then
        -- the cost only when one is known: an agent that reports no price (Codex) spent no known $0
        return format('spent %s tokens of the task''s %s budget%s', to_char(v_spent_tokens, 'FM999,999,999,999,990'),
                      to_char(v_tokens, 'FM999,999,999,999,990'),
                      case when v_spent_cost > 0 then format(' ($%s)', to_char(v_spent_cost, 'FM999999990.0000')) end);
    end if;
    return null;
end
$$;
revoke all on function fleet._over_budget(fleet.tasks,fleet.lanes) from public;
grant execute on function fleet._over_budget(fleet.tasks,fleet.lanes) to service_role;
