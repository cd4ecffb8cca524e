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
    v_allowed text[] := fleet._allowed_lanes();  -- NULL: every lane
    v_bad record;
    v_where text;
    v_seq regclass := pg_catalog.pg_get_serial_sequence('fleet.tasks', 'id')::regclass;
    v_idx int[];
    v_lane text[];
    v_key text[];
    v_title text[];
    v_payload jsonb[];
    v_priority int[];
    v_run_at timestamptz[];
    v_max int[];
    v_tier text[];
    v_profile text[];
    v_max_cost numeric[];
    v_max_tokens bigint[];
    v_extra boolean;
    v_small boolean;
    v_new_ids bigint[];
    v_new_lanes text[];
    v_new_keys text[];
    v_old_idx int[];
    v_old_ids bigint[];
    v_lost int;
    v_forbidden int;
begin
    if p_tasks is null or jsonb_typeof(p_tasks) <> 'array' then
        perform fleet._raise('LF005',
            format('enqueue_many takes a JSON array of task objects, not %s',
                   coalesce('a JSON ' || jsonb_typeof(p_tasks), 'NULL')));
    end if;
    if jsonb_array_length(p_tasks) = 0 then
        return;
    end if;

    -- the lanes named, FOR KEY SHARE (as fleet._lane): a retire in flight is waited for, then read
    perform 1 from fleet.lanes l
     where l.name in (select coalesce(case when jsonb_typeof(x -> 'lane') = 'string' then x ->> 'lane' end, p_lane)
                        from jsonb_array_elements(p_tasks) x)
       for key share;

    -- is the whole array within the smallest payload cap of any lane? (then no payload is past its
    -- lane's: the check per element is skipped)
    v_small := octet_length(p_tasks::text) <= (select min(fleet._max_payload_bytes(l)) from fleet.lanes l);

    -- does any task name a tier, a profile or a budget?
    v_extra := jsonb_path_exists(p_tasks, '$[*] ? (exists(@.tier) || exists(@.profile) || exists(@.max_cost_usd)'
                                          ' || exists(@.max_tokens))');

    -- 1. the first element that enqueue_task would refuse, and why (each check guarded, so a
    --    malformed element never makes a later check raise a less helpful error)
    select b.* into v_bad
      from (
        select e.idx, e.key, e.lane, e.field, e.detail,
               case
                   when jsonb_typeof(e.t) <> 'object' then 'not_object'
                   when e.field is not null then 'unknown_field'
                   when jsonb_typeof(e.t -> 'key') is distinct from 'string' then 'key_type'
                   when coalesce(jsonb_typeof(e.t -> 'lane'), 'null') not in ('string', 'null') then 'lane_type'
                   when e.lane is null then 'no_lane'
                   when not (v_allowed is null or e.lane = any (v_allowed)) then 'lane_forbidden'
                   when length(e.key) not between 1 and 200 then 'key_length'
                   when not exists (select 1 from fleet.lanes l where l.name = e.lane) then 'lane_unknown'
                   when exists (select 1 from fleet.lanes l where l.name = e.lane and l.retired_at is not null)
                        then 'lane_retired'
                   when coalesce(jsonb_typeof(e.t -> 'payload'), 'null') not in ('object', 'null') then 'payload'
                   when not v_small and jsonb_typeof(e.t -> 'payload') = 'object'
                        and octet_length((e.t -> 'payload')::text)
                            > (select fleet._max_payload_bytes(l) from fleet.lanes l where l.name = e.lane)
                        then 'payload_size'
                   when coalesce(jsonb_typeof(e.t -> 'title'), 'null') not in ('string', 'null') then 'title'
                   when coalesce(jsonb_typeof(e.t -> 'priority'), 'null') not in ('number', 'null') then 'priority_type'
                   when jsonb_typeof(e.t -> 'priority') = 'number'
                        and ((e.t ->> 'priority')::numeric not between 0 and 1000
                             or (e.t ->> 'priority')::numeric % 1 <> 0) then 'priority'
                   when coalesce(jsonb_typeof(e.t -> 'run_at'), 'null') not in ('string', 'null') then 'run_at_type'
                   when coalesce(jsonb_typeof(e.t -> 'delay_seconds'), 'null') not in ('number', 'null')
                        then 'delay_type'
                   when jsonb_typeof(e.t -> 'run_at') = 'string' and jsonb_typeof(e.t -> 'delay_seconds') = 'number'
                        then 'run_at_and_delay'
                   when coalesce(jsonb_typeof(e.t -> 'max_attempts'), 'null') not in ('number', 'null')
                        then 'max_attempts_type'
                   when jsonb_typeof(e.t -> 'max_attempts') = 'number'
                        and ((e.t ->> 'max_attempts')::numeric not between 1 and 2147483647
                             or (e.t ->> 'max_attempts')::numeric % 1 <> 0) then 'max_attempts'
                   -- (most batches name none of the four fields below: then they are skipped)
                   when not v_extra then null
                   when coalesce(jsonb_typeof(e.t -> 'tier'), 'null') not in ('string', 'null') then 'tier_type'
                   when jsonb_typeof(e.t -> 'tier') = 'string'
                        and not ((e.t ->> 'tier') = any (fleet._tiers((select l from fleet.lanes l where l.name = e.lane))))
                        then 'tier'
                   when coalesce(jsonb_typeof(e.t -> 'profile'), 'null') not in ('string', 'null') then 'profile_type'
                   when jsonb_typeof(e.t -> 'profile') = 'string'
                        and not fleet._profile_known(e.lane, e.t ->> 'profile') then 'profile'
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
          from (
            select (x.ord - 1)::int as idx, x.t,
                   case when jsonb_typeof(x.t -> 'key') = 'string' then x.t ->> 'key' end as key,
                   coalesce(case when jsonb_typeof(x.t -> 'lane') = 'string' then x.t ->> 'lane' end,
                            p_lane) as lane,
                   case when jsonb_typeof(x.t) = 'object'
                        then (select k from jsonb_object_keys(x.t) k where k <> all (v_fields) order by k limit 1)
                   end as field,
                   case when jsonb_typeof(x.t) = 'object' then x.t else null end as detail
              from jsonb_array_elements(p_tasks) with ordinality x(t, ord)
          ) e
      ) b
     where b.problem is not null
     order by b.idx
     limit 1;

    if found then
        v_where := format('p_tasks[%s]', v_bad.idx)
                   || case when v_bad.key is not null then format(' (key %L)', left(v_bad.key, 100)) else '' end
                   || ': ';
        case v_bad.problem
        when 'not_object' then
            perform fleet._raise('LF005', v_where || format('a task must be a JSON object, not a JSON %s',
                jsonb_typeof(p_tasks -> v_bad.idx)));
        when 'unknown_field' then
            perform fleet._raise('LF005', v_where || format('unknown field %L', left(v_bad.field, 100)),
                'known: ' || array_to_string(v_fields, ', '));
        when 'key_type' then
            perform fleet._raise('LF005', v_where || 'a task needs a key, a string of 1 to 200 characters');
        when 'lane_type' then
            perform fleet._raise('LF005', v_where || format('lane must be a string, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'lane')));
        when 'no_lane' then
            perform fleet._raise('LF005', v_where || 'no lane: give p_lane, or a string "lane" in the task');
        when 'lane_forbidden' then
            perform fleet._raise('LF008', v_where || format('lane %L is not allowed for this key',
                left(v_bad.lane, 100)),
                'the key''s fleet_lanes claim lists the lanes it may work; mint one with `fleet keys mint --lane`');
        when 'key_length' then
            perform fleet._raise('LF005', v_where || 'task key must be 1 to 200 characters');
        when 'lane_unknown' then
            perform fleet._raise('LF002', v_where || format('unknown lane %L', left(v_bad.lane, 100)),
                fleet._lanes_hint());
        when 'lane_retired' then
            perform fleet._raise('LF009', v_where || format('lane %s is retired: it takes no tasks', v_bad.lane),
                format('`fleet lanes unretire %s` brings it back', v_bad.lane));
        when 'payload' then
            perform fleet._raise('LF005', v_where || format('payload must be a JSON object, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'payload')));
        when 'payload_size' then
            perform fleet._raise('LF005', v_where || format('payload is %s bytes, more than lane %s''s max_payload_bytes of %s',
                octet_length((v_bad.detail -> 'payload')::text), v_bad.lane,
                (select fleet._max_payload_bytes(l) from fleet.lanes l where l.name = v_bad.lane)),
                'keep large inputs elsewhere (a file, a URL) and name them in the payload, or raise the lane''s '
                'max_payload_bytes in fleet.toml');
        when 'title' then
            perform fleet._raise('LF005', v_where || format('title must be a string, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'title')));
        when 'priority_type' then
            perform fleet._raise('LF005', v_where || format('priority must be an integer between 0 and 1000, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'priority')), 'higher runs first; the default is 0');
        when 'priority' then
            perform fleet._raise('LF005', v_where || format('priority must be an integer between 0 and 1000, not %s',
                left(v_bad.detail ->> 'priority', 40)), 'higher runs first; the default is 0');
        when 'run_at_type' then
            perform fleet._raise('LF005', v_where || format('run_at must be a timestamp string, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'run_at')));
        when 'delay_type' then
            perform fleet._raise('LF005', v_where || format('delay_seconds must be a number, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'delay_seconds')));
        when 'run_at_and_delay' then
            perform fleet._raise('LF005', v_where || 'give run_at or delay_seconds, not both');
        when 'max_attempts_type' then
            perform fleet._raise('LF005', v_where || format('max_attempts must be an integer of at least 1, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'max_attempts')));
        when 'max_attempts' then
            perform fleet._raise('LF005', v_where || format('max_attempts must be an integer of at least 1, not %s',
                left(v_bad.detail ->> 'max_attempts', 40)));
        when 'tier_type' then
            perform fleet._raise('LF005', v_where || format('tier must be a string, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'tier')));
        when 'tier' then
            perform fleet._raise('LF005', v_where || format('lane %s has no tier %L', v_bad.lane,
                left(v_bad.detail ->> 'tier', 100)),
                (select case when cardinality(fleet._tiers(l)) = 0 then 'the lane names no tiers'
                             else 'its tiers, lowest first: ' || array_to_string(fleet._tiers(l), ', ') end
                   from fleet.lanes l where l.name = v_bad.lane));
        when 'profile_type' then
            perform fleet._raise('LF005', v_where || format('profile must be a string, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'profile')));
        when 'profile' then
            perform fleet._raise('LF005', v_where || format('unknown profile %L', left(v_bad.detail ->> 'profile', 100)),
                fleet._profiles_hint(v_bad.lane));
        when 'max_cost_type' then
            perform fleet._raise('LF005', v_where || format('max_cost_usd must be a number, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'max_cost_usd')));
        when 'max_cost' then
            perform fleet._raise('LF005', v_where || format('max_cost_usd must be at least 0.000001 and below 100,000,000, not %s',
                left(v_bad.detail ->> 'max_cost_usd', 40)), 'a task budget must be positive');
        when 'max_tokens_type' then
            perform fleet._raise('LF005', v_where || format('max_tokens must be an integer, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'max_tokens')));
        else  -- 'max_tokens'
            perform fleet._raise('LF005', v_where || format('max_tokens must be an integer of at least 1, not %s',
                left(v_bad.detail ->> 'max_tokens', 40)), 'a task budget must be positive');
        end case;
    end if;

    -- 2. the typed values. Only a timestamp can still be malformed ('2030-13-45', a delay past
    --    the calendar): then find which element, and say so. (PostgreSQL's own words such as
    --    'tomorrow' or 'infinity' are timestamps, as enqueue_task takes them.)
    begin
        select array_agg((x.ord - 1)::int order by x.ord),
               array_agg(coalesce(case when jsonb_typeof(x.t -> 'lane') = 'string' then x.t ->> 'lane' end, p_lane)
                         order by x.ord),
               array_agg(x.t ->> 'key' order by x.ord),
               array_agg(x.t ->> 'title' order by x.ord),
               array_agg(case when jsonb_typeof(x.t -> 'payload') = 'object' then x.t -> 'payload' else '{}' end
                         order by x.ord),
               array_agg(coalesce((x.t ->> 'priority')::numeric::int, 0) order by x.ord),
               array_agg(coalesce((x.t ->> 'run_at')::timestamptz,
                                  now() + make_interval(secs => coalesce((x.t ->> 'delay_seconds')::double precision, 0)))
                         order by x.ord),
               array_agg((x.t ->> 'max_attempts')::numeric::int order by x.ord)
          into v_idx, v_lane, v_key, v_title, v_payload, v_priority, v_run_at, v_max
          from jsonb_array_elements(p_tasks) with ordinality x(t, ord);
    exception when data_exception then
        for v_bad in select (x.ord - 1)::int as idx, x.t from jsonb_array_elements(p_tasks) with ordinality x(t, ord)
                      order by x.ord
        loop
            begin
                perform coalesce((v_bad.t ->> 'run_at')::timestamptz,
                                 now() + make_interval(secs => coalesce((v_bad.t ->> 'delay_seconds')::double precision, 0)));
            exception when data_exception then
                perform fleet._raise('LF005', format('p_tasks[%s] (key %L): ', v_bad.idx, left(v_bad.t ->> 'key', 100))
                    || case when v_bad.t ? 'run_at' and jsonb_typeof(v_bad.t -> 'run_at') = 'string'
                            then format('run_at %L is not a timestamp: %s', left(v_bad.t ->> 'run_at', 100), sqlerrm)
                            else format('delay_seconds %s is out of range: %s', left(v_bad.t ->> 'delay_seconds', 40), sqlerrm) end,
                    'run_at: an ISO 8601 time with a zone, e.g. 2030-01-02T03:04:05Z; delay_seconds: seconds from now');
            end;
        end loop;
        raise;  -- not a timestamp after all: the original error
    end;
    -- the tier, profile and budget of each task, when any task names one (NULL arrays otherwise:
    -- unnest pads them with NULLs below)
    if v_extra then
        select array_agg(x.t ->> 'tier' order by x.ord),
               array_agg(x.t ->> 'profile' order by x.ord),
               array_agg((x.t ->> 'max_cost_usd')::numeric order by x.ord),
               array_agg((x.t ->> 'max_tokens')::numeric::bigint order by x.ord)
          into v_tier, v_profile, v_max_cost, v_max_tokens
          from jsonb_array_elements(p_tasks) with ordinality x(t, ord);
    end if;

    -- 3. insert the new keys: the first element of each (lane, key) that names no task yet
    --    (fleet._key_holder: the task in the lane, or one that was in it and moved on)
    with item as (
        select u.* from unnest(v_idx, v_lane, v_key, v_title, v_payload, v_priority, v_run_at, v_max,
                               v_tier, v_profile, v_max_cost, v_max_tokens)
                        as u(idx, lane, key, title, payload, priority, run_at, max_attempts,
                             tier, profile, max_cost_usd, max_tokens)
    ), firsts as (
        select distinct on (i.lane, i.key) i.* from item i
         where not exists (select 1 from fleet._key_holder(i.lane, i.key))
         order by i.lane, i.key, i.idx
    ), numbered as materialized (
        -- ids and journal positions drawn in input order (the subquery's ORDER BY is the order
        -- nextval runs in)
        select f.*, nextval(v_seq) as new_id, nextval('fleet.events_id_seq') as journal_id
          from (select * from firsts order by firsts.idx) f
    ), ins as (
        insert into fleet.tasks as t (id, journal_id, lane, key, title, payload, priority, run_at, max_attempts,
                                      tier, profile, max_cost_usd, max_tokens)
        overriding system value
        select n.new_id, n.journal_id, n.lane, n.key, n.title, n.payload, n.priority, n.run_at, n.max_attempts,
               n.tier, n.profile, n.max_cost_usd, n.max_tokens
          from numbered n
         order by n.key, n.lane  -- the lock order on the key index (key, lane)
        on conflict (key, lane) do nothing
        returning t.id, t.lane, t.key
    )
    select coalesce(array_agg(ins.id), '{}'), coalesce(array_agg(ins.lane), '{}'), coalesce(array_agg(ins.key), '{}')
      into v_new_ids, v_new_lanes, v_new_keys from ins;

    -- 4. the keys that named a task already (or were inserted by another call while the insert
    --    waited for it: a statement of its own, whose snapshot sees them, as enqueue_task does):
    --    their task, and the first whose task was routed on to a lane this caller may not work
    --    is refused as enqueue_task refuses it
    select array_agg(e.idx order by e.idx), array_agg(h.id order by e.idx),
           min(e.idx) filter (where h.id is null),
           min(e.idx) filter (where not (v_allowed is null or h.lane = any (v_allowed)))
      into v_old_idx, v_old_ids, v_lost, v_forbidden
      from (select e.* from unnest(v_idx, v_lane, v_key) as e(idx, lane, key)
             where not exists (select 1 from unnest(v_new_lanes, v_new_keys) as n(lane, key)
                                where n.lane = e.lane and n.key = e.key)) e
      left join lateral fleet._key_holder(e.lane, e.key) h on true;
    if v_lost is not null then  -- (as in enqueue_task: never seen)
        raise exception using errcode = 'serialization_failure',
            message = format('p_tasks[%s] (key %L): the key changed hands during this enqueue; try again',
                             v_lost, left(v_key[v_lost + 1], 100));
    end if;
    if v_forbidden is not null then
        perform fleet._raise('LF008', format('p_tasks[%s] (key %L): the key''s task of lane %s has moved on to a lane '
                                             'not allowed for this key',
            v_forbidden, left(v_key[v_forbidden + 1], 100), v_lane[v_forbidden + 1]),
            'a key names one task in each lane, and a routed task keeps its key in the lanes it left');
    end if;

    -- 5. every element: its task, and whether this call created it (only the first element of a
    --    new (lane, key))
    return query
    select i.idx, coalesce(n.id, o.id), i.key, n.id is not null and i.idx = f.idx
      from unnest(v_idx, v_lane, v_key) as i(idx, lane, key)
      join (select j.lane, j.key, min(j.idx) as idx from unnest(v_idx, v_lane, v_key) as j(idx, lane, key)
             group by j.lane, j.key) f
        on f.lane = i.lane and f.key = i.key
      left join unnest(v_new_ids, v_new_lanes, v_new_keys) as n(id, lane, key) on n.lane = i.lane and n.key = i.key
      left join unnest(v_old_idx, v_old_ids) as o(idx, id) on o.idx = i.idx
     order by i.idx;
end
$$;
comment on function fleet.enqueue_many is
    'enqueue_task for many tasks at once, all or nothing: (idx, id, key, created) per element, in input '
    'order; keys are per lane, as enqueue_task takes them. An element: key, and optionally lane, payload, '
    'title, priority, run_at or delay_seconds, max_attempts, tier, profile, max_cost_usd, max_tokens.';
revoke all on function fleet.enqueue_many(text,jsonb) from public;
grant execute on function fleet.enqueue_many(text,jsonb) to fleet_operator, fleet_worker, service_role;
