-- Queueing tasks: one, after a delay, or many in one statement.
--
-- The one hand-edited definition of each function and view below. A change here needs a
-- migration made from it: `uv run python -m worker.dev.sqlsources new <name>` (see README).

-- Keys are per lane: a key names one task in each lane, the task enqueued into the lane with it or
-- routed into the lane with it. A task keeps its key in every lane it has been in (its stages):
-- enqueueing the key into a lane the task has left answers with that task, wherever it went, and
-- fleet.route does not take a task into a lane that has another task of its key. The same key in
-- two lanes that never shared a task is two tasks.
create or replace function fleet._key_holder(p_lane text, p_key text)
returns table (id bigint, lane text)
language sql
stable
as $$
    select t.id, t.lane
      from fleet.tasks t
     where t.key = p_key
       and (t.lane = p_lane or t.stages @> jsonb_build_array(jsonb_build_object('lane', p_lane)))
     order by t.lane = p_lane desc, t.id
     limit 1;
$$;
revoke all on function fleet._key_holder(text,text) from public;
grant execute on function fleet._key_holder(text,text) to service_role;

-- The most bytes a task's payload may take in lane l (its JSON text): the lane's
-- max_payload_bytes, 1 MiB unless fleet.toml says otherwise.
create or replace function fleet._max_payload_bytes(l fleet.lanes)
returns bigint
language sql
immutable
as $$
    select case when jsonb_typeof(l.config -> 'max_payload_bytes') = 'number'
                then (l.config ->> 'max_payload_bytes')::numeric::bigint
                else 1048576 end;
$$;
revoke all on function fleet._max_payload_bytes(fleet.lanes) from public;
grant execute on function fleet._max_payload_bytes(fleet.lanes) to service_role;

create or replace function fleet.enqueue_task(
    p_lane text, p_key text, p_payload jsonb default '{}', p_priority int default 0,
    p_run_at timestamptz default now(), p_max_attempts int default null, p_title text default null,
    p_tier text default null, p_profile text default null, p_max_cost_usd numeric default null,
    p_max_tokens bigint default null)
returns table (task_id bigint, created boolean)
language plpgsql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
#variable_conflict use_column
declare
    v_id bigint;
    v_lane text;
    v_size bigint;
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
    v_size := octet_length(p_payload::text);
    if v_size > fleet._max_payload_bytes(l) then
        perform fleet._raise('LF005',
            format('payload is %s bytes, more than lane %s''s max_payload_bytes of %s', v_size, p_lane,
                   fleet._max_payload_bytes(l)),
            'keep large inputs elsewhere (a file, a URL) and name them in the payload, or raise the lane''s '
            'max_payload_bytes in fleet.toml');
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
    if p_profile is not null and not fleet._profile_known(p_lane, p_profile) then
        perform fleet._raise('LF005', format('unknown profile %L', left(p_profile, 100)), fleet._profiles_hint(p_lane));
    end if;

    -- the key's task in this lane, if it has one (fleet._key_holder); else a new one. A concurrent
    -- enqueue of the same key into this lane waits on the key's index entry and then finds the
    -- task the other made (the second select: a statement of its own, whose snapshot sees it).
    select h.id, h.lane into v_id, v_lane from fleet._key_holder(p_lane, p_key) h;
    if v_id is null then
        insert into fleet.tasks (lane, key, title, payload, priority, run_at, max_attempts, tier, profile,
                                 max_cost_usd, max_tokens)
        values (p_lane, p_key, p_title, coalesce(p_payload, '{}'), p_priority, coalesce(p_run_at, now()),
                p_max_attempts, fleet._tier_for(l, p_tier), p_profile, p_max_cost_usd, p_max_tokens)
        on conflict (key, lane) do nothing
        returning id into v_id;
        if v_id is not null then  -- (the task row is its entry in the journal: fleet.journal)
            return query select v_id, true;
            return;
        end if;
        select h.id, h.lane into v_id, v_lane from fleet._key_holder(p_lane, p_key) h;
        if v_id is null then  -- (the key's task left and came back while this waited: never seen)
            raise exception using errcode = 'serialization_failure',
                message = format('key %L of lane %s changed hands during this enqueue; try again', left(p_key, 100), p_lane);
        end if;
    end if;
    -- the key's task was routed on to a lane this caller may not work: say so, without naming it
    if not fleet._lane_allowed(v_lane) then
        perform fleet._raise('LF008',
            format('key %L of lane %s belongs to a task that has moved on to a lane not allowed for this key',
                   left(p_key, 100), p_lane),
            'a key names one task in each lane, and a routed task keeps its key in the lanes it left');
    end if;
    return query select v_id, false;
end
$$;
comment on function fleet.enqueue_task is
    'enqueue, also saying whether the key was new in the lane (created) or already named a task there';
revoke all on function fleet.enqueue_task(text,text,jsonb,integer,timestamp with time zone,integer,text,text,text,numeric,bigint) from public;
grant execute on function fleet.enqueue_task(text,text,jsonb,integer,timestamp with time zone,integer,text,text,text,numeric,bigint) to fleet_operator, fleet_worker, service_role;

create or replace function fleet.enqueue(
    p_lane text, p_key text, p_payload jsonb default '{}', p_priority int default 0,
    p_run_at timestamptz default now(), p_max_attempts int default null, p_title text default null)
returns bigint
language sql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
    select task_id from fleet.enqueue_task(p_lane, p_key, p_payload, p_priority, p_run_at,
                                           p_max_attempts, p_title);
$$;
comment on function fleet.enqueue is
    'queue a task; idempotent on (lane, key): the same key in the same lane returns the existing id';
revoke all on function fleet.enqueue(text,text,jsonb,integer,timestamp with time zone,integer,text) from public;
grant execute on function fleet.enqueue(text,text,jsonb,integer,timestamp with time zone,integer,text) to fleet_operator, fleet_worker, service_role;

create or replace function fleet.enqueue_after(
    p_delay_seconds double precision, p_lane text, p_key text, p_payload jsonb default '{}',
    p_priority int default 0, p_max_attempts int default null, p_title text default null,
    p_tier text default null, p_profile text default null, p_max_cost_usd numeric default null,
    p_max_tokens bigint default null)
returns table (task_id bigint, created boolean)
language sql
security definer
set search_path = pg_catalog, fleet, pg_temp
as $$
    select e.task_id, e.created
      from fleet.enqueue_task(p_lane, p_key, p_payload, p_priority,
                              now() + make_interval(secs => coalesce(p_delay_seconds, 0)),
                              p_max_attempts, p_title, p_tier, p_profile, p_max_cost_usd, p_max_tokens) e;
$$;
revoke all on function fleet.enqueue_after(double precision,text,text,jsonb,integer,integer,text,text,text,numeric,bigint) from public;
grant execute on function fleet.enqueue_after(double precision,text,text,jsonb,integer,integer,text,text,text,numeric,bigint) to fleet_operator, fleet_worker, service_role;

create or replace function fleet.enqueue_many(p_lane text, p_tasks jsonb)
returns table (idx int, id bigint, key text, created boolean)
language plpgsql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
#variable_conflict use_column
declare
    v_fields constant text[] := array['key', 'lane', 'payload', 'title', 'priority', 'run_at',
                                      'delay_seconds', 'max_attempts', 'tier', 'profile',
                                      'max_cost_usd', 'max_tokens'];
    -- (most elements name none of these: an element without them skips their checks)
    v_optional constant text[] := array['title', 'priority', 'run_at', 'delay_seconds', 'max_attempts',
                                        'tier', 'profile', 'max_cost_usd', 'max_tokens'];
    v_extras constant text[] := array['tier', 'profile', 'max_cost_usd', 'max_tokens'];
    v_allowed text[] := fleet._allowed_lanes();  -- NULL: every lane
    v_seq regclass := pg_catalog.pg_get_serial_sequence('fleet.tasks', 'id')::regclass;
    v_times boolean := true;  -- false: the pass again without the times, after one was no timestamp
    v_state text;             -- (and that error)
    v_error text;
    v_bad int;                -- the first element enqueue_task would refuse, and why
    v_problem text;
    v_forbidden int;          -- the first whose key's task moved on to a lane not allowed for this key
    v_inserted bigint;        -- how many new tasks the insert made
    v_lost int;
    v_ids bigint[];           -- per element, in input order: its task, its key, whether this call made it
    v_keys text[];
    v_created boolean[];
    v_new bigint[];           -- the ids drawn for new tasks, in input order (a conflict used none)
    v_t jsonb;                -- an element refused: it, its key, lane and first unknown field
    v_key text;
    v_lane text;
    v_field text;
    v_where text;
begin
    if p_tasks is null or jsonb_typeof(p_tasks) <> 'array' then
        perform fleet._raise('LF005',
            format('enqueue_many takes a JSON array of task objects, not %s',
                   coalesce('a JSON ' || jsonb_typeof(p_tasks), 'NULL')));
    end if;
    if jsonb_array_length(p_tasks) = 0 then
        return;
    end if;

    -- 1. One statement, one pass over the elements: each element's checks (the first that
    --    enqueue_task would refuse, each check guarded so that a malformed element never makes a
    --    later check raise a less helpful error), its key's task (fleet._key_holder, as a join),
    --    and, when no element is refused, the insert of the new keys and every element's task.
    --    Only a timestamp can still be malformed ('2030-13-45', a delay past the calendar): then
    --    the pass runs again without the times, so that a refused element anywhere is named first,
    --    and else the element with the bad time. (PostgreSQL's own words such as 'tomorrow' or
    --    'infinity' are timestamps, as enqueue_task takes them.)
    <<pass>>
    loop
        begin
            with e as materialized (
                -- (the key compares as fleet.tasks.key does, byte by byte: collation "C"; what
                -- every element is asked for is taken out of it here, once: each read of x.t from
                -- a materialized row copies it)
                select (x.ord - 1)::int as idx, x.t,
                       (case when jsonb_typeof(x.t -> 'key') = 'string' then x.t ->> 'key' end) collate "C" as key,
                       coalesce(case when jsonb_typeof(x.t -> 'lane') = 'string' then x.t ->> 'lane' end,
                                p_lane) as lane,
                       x.t -> 'payload' as payload,
                       x.t ?| v_optional as opt  -- names a field past key, lane and payload
                  from jsonb_array_elements(p_tasks) with ordinality x(t, ord)
            ), named as materialized (
                -- the lanes named, FOR KEY SHARE (as fleet._lane): a retire in flight is waited
                -- for, and the rows read are what it left
                select l.name, l.retired_at is not null as retired, fleet._max_payload_bytes(l) as max_bytes,
                       fleet._tiers(l) as tiers, fleet._tier_for(l, null) as default_tier,
                       case when v_allowed is not null then array(select fleet._lane_profiles(l.name)) end
                           as profiles
                  from fleet.lanes l
                 where l.name in (select e.lane from e)
                   for key share of l
            ), c as materialized (
                select e.idx, e.t, e.key, e.lane, e.payload, e.opt, coalesce(h.here, h.moved) as holder,
                       case when h.here is not null then e.lane
                            when h.moved is not null then (select t.lane from fleet.tasks t where t.id = h.moved)
                       end as holder_lane,
                       case when v_times then
                           case when not e.opt then now()
                                when jsonb_typeof(e.t -> 'run_at') = 'string' then (e.t ->> 'run_at')::timestamptz
                                when jsonb_typeof(e.t -> 'delay_seconds') = 'number'
                                    then now() + make_interval(secs => (e.t ->> 'delay_seconds')::double precision)
                                else now() end
                       end as run_at,
                       case
                           when jsonb_typeof(e.t) <> 'object' then 'not_object'
                           when e.t - v_fields <> '{}' then 'unknown_field'
                           when e.key is null then 'key_type'
                           when coalesce(jsonb_typeof(e.t -> 'lane'), 'null') not in ('string', 'null') then 'lane_type'
                           when e.lane is null then 'no_lane'
                           when not (v_allowed is null or e.lane = any (v_allowed)) then 'lane_forbidden'
                           when length(e.key) not between 1 and 200 then 'key_length'
                           when n.name is null then 'lane_unknown'
                           when n.retired then 'lane_retired'
                           when coalesce(jsonb_typeof(e.payload), 'null') not in ('object', 'null') then 'payload'
                           when jsonb_typeof(e.payload) = 'object'
                                and octet_length(e.payload::text) > n.max_bytes then 'payload_size'
                           -- (an element of key, lane and payload only, the most common, is done)
                           when not e.opt then null
                           when coalesce(jsonb_typeof(e.t -> 'title'), 'null') not in ('string', 'null') then 'title'
                           when coalesce(jsonb_typeof(e.t -> 'priority'), 'null') not in ('number', 'null')
                                then 'priority_type'
                           when jsonb_typeof(e.t -> 'priority') = 'number'
                                and ((e.t ->> 'priority')::numeric not between 0 and 1000
                                     or (e.t ->> 'priority')::numeric % 1 <> 0) then 'priority'
                           when coalesce(jsonb_typeof(e.t -> 'run_at'), 'null') not in ('string', 'null')
                                then 'run_at_type'
                           when coalesce(jsonb_typeof(e.t -> 'delay_seconds'), 'null') not in ('number', 'null')
                                then 'delay_type'
                           when jsonb_typeof(e.t -> 'run_at') = 'string' and jsonb_typeof(e.t -> 'delay_seconds') = 'number'
                                then 'run_at_and_delay'
                           when coalesce(jsonb_typeof(e.t -> 'max_attempts'), 'null') not in ('number', 'null')
                                then 'max_attempts_type'
                           when jsonb_typeof(e.t -> 'max_attempts') = 'number'
                                and ((e.t ->> 'max_attempts')::numeric not between 1 and 2147483647
                                     or (e.t ->> 'max_attempts')::numeric % 1 <> 0) then 'max_attempts'
                           when not (e.t ?| v_extras) then null
                           when coalesce(jsonb_typeof(e.t -> 'tier'), 'null') not in ('string', 'null') then 'tier_type'
                           when jsonb_typeof(e.t -> 'tier') = 'string' and not ((e.t ->> 'tier') = any (n.tiers))
                                then 'tier'
                           when coalesce(jsonb_typeof(e.t -> 'profile'), 'null') not in ('string', 'null')
                                then 'profile_type'
                           -- (fleet._profile_known: any profile for a caller of every lane, else one
                           -- of the lane's, which the caller may work by now)
                           when jsonb_typeof(e.t -> 'profile') = 'string'
                                and not (case when v_allowed is null
                                              then (e.t ->> 'profile') in (select p.name from fleet.profiles p)
                                              else (e.t ->> 'profile') = any (n.profiles) end) then 'profile'
                           when coalesce(jsonb_typeof(e.t -> 'max_cost_usd'), 'null') not in ('number', 'null')
                                then 'max_cost_type'
                           -- (as the column stores it, to the microdollar)
                           when round((e.t ->> 'max_cost_usd')::numeric, 6) <= 0
                                or round((e.t ->> 'max_cost_usd')::numeric, 6) >= 1e8
                                then 'max_cost'
                           when coalesce(jsonb_typeof(e.t -> 'max_tokens'), 'null') not in ('number', 'null')
                                then 'max_tokens_type'
                           when jsonb_typeof(e.t -> 'max_tokens') = 'number'
                                and ((e.t ->> 'max_tokens')::numeric not between 1 and 9223372036854775807
                                     or (e.t ->> 'max_tokens')::numeric % 1 <> 0) then 'max_tokens'
                       end as problem
                  from e
                  left join named n on n.name = e.lane
                  -- the key's task in the lane, else the first that was in it and moved on
                  -- (fleet._key_holder)
                  left join lateral (
                      select min(t.id) filter (where t.lane = e.lane) as here, min(t.id) as moved
                        from fleet.tasks t
                       where t.key = e.key
                         and (t.lane = e.lane or t.stages @> jsonb_build_array(jsonb_build_object('lane', e.lane)))
                  ) h on true
            ), fresh as materialized (
                -- each element in input order, and the id of its new task when its key names no
                -- task yet (none when an element is refused): drawn in input order (the
                -- subquery's ORDER BY is the order nextval runs in, and the order of this CTE's
                -- rows, which the aggregates below keep)
                -- (and its position in the journal: fleet.journal)
                select s.*,
                       case when s.is_new then nextval(v_seq) end as new_id,
                       case when s.is_new then nextval('fleet.events_id_seq') end as journal_id
                  from (select c.*, c.holder is null and v_times
                                    and not exists (select 1 from c x where x.problem is not null) as is_new
                          from c order by c.idx) s
                 order by s.idx
            ), ins as (
                -- in the lock order of the key index (key, lane), the first element of a (lane, key)
                -- first: the others of the batch conflict with it (as a key another call took
                -- while this waited for it does) and make no task
                insert into fleet.tasks as t (id, journal_id, lane, key, title, payload, priority, run_at,
                                              max_attempts, tier, profile, max_cost_usd, max_tokens)
                overriding system value
                select f.new_id, f.journal_id, f.lane, f.key, case when f.opt then f.t ->> 'title' end,
                       case when jsonb_typeof(f.payload) = 'object' then f.payload else '{}' end,
                       coalesce(case when f.opt then (f.t ->> 'priority')::numeric::int end, 0), f.run_at,
                       case when f.opt then (f.t ->> 'max_attempts')::numeric::int end,
                       -- no tier named: the lane's default, as enqueue_task stores it
                       coalesce(case when f.opt then f.t ->> 'tier' end,
                                (select n.default_tier from named n where n.name = f.lane)),
                       case when f.opt then f.t ->> 'profile' end,
                       case when f.opt then (f.t ->> 'max_cost_usd')::numeric end,
                       case when f.opt then (f.t ->> 'max_tokens')::numeric::bigint end
                  from fresh f
                 where f.new_id is not null
                 order by f.key, f.lane, f.idx
                on conflict (key, lane) do nothing
                returning 1
            )
            select min(f.idx) filter (where f.problem is not null),
                   (array_agg(f.problem) filter (where f.problem is not null))[1],
                   min(f.idx) filter (where not (v_allowed is null or f.holder_lane = any (v_allowed))),
                   (select count(*) from ins),
                   array_agg(coalesce(f.holder, f.new_id)),
                   array_agg(f.key),
                   array_agg(f.new_id is not null),
                   coalesce(array_agg(f.new_id) filter (where f.new_id is not null), '{}')
              into v_bad, v_problem, v_forbidden, v_inserted, v_ids, v_keys, v_created, v_new
              from fresh f;
            exit pass;
        exception when data_exception then
            if not v_times then
                raise;
            end if;
            get stacked diagnostics v_state = returned_sqlstate, v_error = message_text;
            v_times := false;
        end;
    end loop;

    if v_bad is not null then
        v_t := p_tasks -> v_bad;
        v_key := case when jsonb_typeof(v_t -> 'key') = 'string' then v_t ->> 'key' end;
        v_lane := coalesce(case when jsonb_typeof(v_t -> 'lane') = 'string' then v_t ->> 'lane' end, p_lane);
        v_field := (select k from jsonb_object_keys(case when jsonb_typeof(v_t) = 'object' then v_t end) k
                     where k <> all (v_fields) order by k limit 1);
        v_where := format('p_tasks[%s]', v_bad)
                   || case when v_key is not null then format(' (key %L)', left(v_key, 100)) else '' end
                   || ': ';
        case v_problem
        when 'not_object' then
            perform fleet._raise('LF005', v_where || format('a task must be a JSON object, not a JSON %s',
                jsonb_typeof(p_tasks -> v_bad)));
        when 'unknown_field' then
            perform fleet._raise('LF005', v_where || format('unknown field %L', left(v_field, 100)),
                'known: ' || array_to_string(v_fields, ', '));
        when 'key_type' then
            perform fleet._raise('LF005', v_where || 'a task needs a key, a string of 1 to 200 characters');
        when 'lane_type' then
            perform fleet._raise('LF005', v_where || format('lane must be a string, not a JSON %s',
                jsonb_typeof(v_t -> 'lane')));
        when 'no_lane' then
            perform fleet._raise('LF005', v_where || 'no lane: give p_lane, or a string "lane" in the task');
        when 'lane_forbidden' then
            perform fleet._raise('LF008', v_where || format('lane %L is not allowed for this key',
                left(v_lane, 100)),
                'the key''s fleet_lanes claim lists the lanes it may work; mint one with `fleet keys mint --lane`');
        when 'key_length' then
            perform fleet._raise('LF005', v_where || 'task key must be 1 to 200 characters');
        when 'lane_unknown' then
            perform fleet._raise('LF002', v_where || format('unknown lane %L', left(v_lane, 100)),
                fleet._lanes_hint());
        when 'lane_retired' then
            perform fleet._raise('LF009', v_where || format('lane %s is retired: it takes no tasks', v_lane),
                format('`fleet lanes unretire %s` brings it back', v_lane));
        when 'payload' then
            perform fleet._raise('LF005', v_where || format('payload must be a JSON object, not a JSON %s',
                jsonb_typeof(v_t -> 'payload')));
        when 'payload_size' then
            perform fleet._raise('LF005', v_where || format('payload is %s bytes, more than lane %s''s max_payload_bytes of %s',
                octet_length((v_t -> 'payload')::text), v_lane,
                (select fleet._max_payload_bytes(l) from fleet.lanes l where l.name = v_lane)),
                'keep large inputs elsewhere (a file, a URL) and name them in the payload, or raise the lane''s '
                'max_payload_bytes in fleet.toml');
        when 'title' then
            perform fleet._raise('LF005', v_where || format('title must be a string, not a JSON %s',
                jsonb_typeof(v_t -> 'title')));
        when 'priority_type' then
            perform fleet._raise('LF005', v_where || format('priority must be an integer between 0 and 1000, not a JSON %s',
                jsonb_typeof(v_t -> 'priority')), 'higher runs first; the default is 0');
        when 'priority' then
            perform fleet._raise('LF005', v_where || format('priority must be an integer between 0 and 1000, not %s',
                left(v_t ->> 'priority', 40)), 'higher runs first; the default is 0');
        when 'run_at_type' then
            perform fleet._raise('LF005', v_where || format('run_at must be a timestamp string, not a JSON %s',
                jsonb_typeof(v_t -> 'run_at')));
        when 'delay_type' then
            perform fleet._raise('LF005', v_where || format('delay_seconds must be a number, not a JSON %s',
                jsonb_typeof(v_t -> 'delay_seconds')));
        when 'run_at_and_delay' then
            perform fleet._raise('LF005', v_where || 'give run_at or delay_seconds, not both');
        when 'max_attempts_type' then
            perform fleet._raise('LF005', v_where || format('max_attempts must be an integer of at least 1, not a JSON %s',
                jsonb_typeof(v_t -> 'max_attempts')));
        when 'max_attempts' then
            perform fleet._raise('LF005', v_where || format('max_attempts must be an integer of at least 1, not %s',
                left(v_t ->> 'max_attempts', 40)));
        when 'tier_type' then
            perform fleet._raise('LF005', v_where || format('tier must be a string, not a JSON %s',
                jsonb_typeof(v_t -> 'tier')));
        when 'tier' then
            perform fleet._raise('LF005', v_where || format('lane %s has no tier %L', v_lane,
                left(v_t ->> 'tier', 100)),
                (select case when cardinality(fleet._tiers(l)) = 0 then 'the lane names no tiers'
                             else 'its tiers, lowest first: ' || array_to_string(fleet._tiers(l), ', ') end
                   from fleet.lanes l where l.name = v_lane));
        when 'profile_type' then
            perform fleet._raise('LF005', v_where || format('profile must be a string, not a JSON %s',
                jsonb_typeof(v_t -> 'profile')));
        when 'profile' then
            perform fleet._raise('LF005', v_where || format('unknown profile %L', left(v_t ->> 'profile', 100)),
                fleet._profiles_hint(v_lane));
        when 'max_cost_type' then
            perform fleet._raise('LF005', v_where || format('max_cost_usd must be a number, not a JSON %s',
                jsonb_typeof(v_t -> 'max_cost_usd')));
        when 'max_cost' then
            perform fleet._raise('LF005', v_where || format('max_cost_usd must be at least 0.000001 and below 100,000,000, not %s',
                left(v_t ->> 'max_cost_usd', 40)), 'a task budget must be positive');
        when 'max_tokens_type' then
            perform fleet._raise('LF005', v_where || format('max_tokens must be an integer, not a JSON %s',
                jsonb_typeof(v_t -> 'max_tokens')));
        else  -- 'max_tokens'
            perform fleet._raise('LF005', v_where || format('max_tokens must be an integer of at least 1, not %s',
                left(v_t ->> 'max_tokens', 40)), 'a task budget must be positive');
        end case;
    end if;
    if not v_times then  -- no element refused: the first whose time is no time
        for v_bad, v_t in select (x.ord - 1)::int, x.t from jsonb_array_elements(p_tasks) with ordinality x(t, ord)
                           order by x.ord
        loop
            begin
                perform coalesce((v_t ->> 'run_at')::timestamptz,
                                 now() + make_interval(secs => coalesce((v_t ->> 'delay_seconds')::double precision, 0)));
            exception when data_exception then
                perform fleet._raise('LF005', format('p_tasks[%s] (key %L): ', v_bad, left(v_t ->> 'key', 100))
                    || case when v_t ? 'run_at' and jsonb_typeof(v_t -> 'run_at') = 'string'
                            then format('run_at %L is not a timestamp: %s', left(v_t ->> 'run_at', 100), sqlerrm)
                            else format('delay_seconds %s is out of range: %s', left(v_t ->> 'delay_seconds', 40), sqlerrm) end,
                    'run_at: an ISO 8601 time with a zone, e.g. 2030-01-02T03:04:05Z; delay_seconds: seconds from now');
            end;
        end loop;
        raise exception using errcode = v_state, message = v_error;  -- not a timestamp after all
    end if;

    -- 2. the elements whose insert conflicted: with an element before them of the same (lane,
    --    key), or with a key another call inserted while the insert waited for it. Their task (a
    --    statement of its own, whose snapshot sees what the other call inserted, as enqueue_task
    --    does), or never seen.
    if v_inserted < cardinality(v_new) then
        select array_agg(case when not r.created or t.id is not null then r.id else h.id end order by r.ord),
               array_agg(r.created and t.id is not null order by r.ord),
               min(r.ord - 1) filter (where r.created and t.id is null and h.id is null),
               least(v_forbidden, min(r.ord - 1) filter (where r.created and t.id is null
                                                           and not (v_allowed is null or h.lane = any (v_allowed))))
          into v_ids, v_created, v_lost, v_forbidden
          from unnest(v_ids, v_keys, v_created) with ordinality r(id, key, created, ord)
          left join fleet.tasks t on r.created and t.id = r.id
          left join lateral (
              select k.id, k.lane
                from fleet._key_holder(coalesce(case when jsonb_typeof(p_tasks -> (r.ord::int - 1) -> 'lane') = 'string'
                                                     then p_tasks -> (r.ord::int - 1) ->> 'lane' end, p_lane), r.key) k
               where r.created and t.id is null) h on true;
    end if;
    if v_lost is not null then
        raise exception using errcode = 'serialization_failure',
            message = format('p_tasks[%s] (key %L): the key changed hands during this enqueue; try again',
                             v_lost, left(v_keys[v_lost + 1], 100));
    end if;
    -- the first whose key's task was routed on to a lane this caller may not work is refused as
    -- enqueue_task refuses it
    if v_forbidden is not null then
        v_t := p_tasks -> v_forbidden;
        perform fleet._raise('LF008', format('p_tasks[%s] (key %L): the key''s task of lane %s has moved on to a lane '
                                             'not allowed for this key',
            v_forbidden, left(v_keys[v_forbidden + 1], 100),
            coalesce(case when jsonb_typeof(v_t -> 'lane') = 'string' then v_t ->> 'lane' end, p_lane)),
            'a key names one task in each lane, and a routed task keeps its key in the lanes it left');
    end if;

    -- 3. every element: its task, and whether this call created it (only the first element of a
    --    new (lane, key))
    return query
    select (r.ord - 1)::int, r.id, r.key, r.created
      from unnest(v_ids, v_keys, v_created) with ordinality r(id, key, created, ord)
     order by r.ord;
end
$$;
comment on function fleet.enqueue_many is
    'enqueue_task for many tasks at once, all or nothing: (idx, id, key, created) per element, in input '
    'order; keys are per lane, as enqueue_task takes them. An element: key, and optionally lane, payload, '
    'title, priority, run_at or delay_seconds, max_attempts, tier, profile, max_cost_usd, max_tokens.';
revoke all on function fleet.enqueue_many(text,jsonb) from public;
grant execute on function fleet.enqueue_many(text,jsonb) to fleet_operator, fleet_worker, service_role;

-- enqueue_many's answer as one value, a JSON array of {idx, id, key, created} in input order: the
-- call of the Supabase store. PostgREST cuts a set of rows at its db-max-rows (1,000 on Supabase),
-- and a call that writes cannot be made again to read the rest; one value is never cut. The same
-- transaction, the same refusals.
create or replace function fleet.enqueue_many_json(p_lane text, p_tasks jsonb)
returns jsonb
language sql
security definer set search_path = pg_catalog, fleet, pg_temp
as $$
    select coalesce(jsonb_agg(jsonb_build_object('idx', e.idx, 'id', e.id, 'key', e.key, 'created', e.created)
                              order by e.idx), '[]')
      from fleet.enqueue_many(p_lane, p_tasks) e;
$$;
comment on function fleet.enqueue_many_json(text, jsonb) is
    'fleet.enqueue_many with its answer as one JSON array of {idx, id, key, created}, in input order '
    '(one value: PostgREST''s db-max-rows does not cut it).';
revoke all on function fleet.enqueue_many_json(text,jsonb) from public;
grant execute on function fleet.enqueue_many_json(text,jsonb) to fleet_operator, fleet_worker, service_role;
