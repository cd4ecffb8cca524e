-- lanefleet: the bulk API (issue #7) and the storage settings of the hot tables.
--
--   enqueue_many(lane, tasks jsonb)          many enqueue_task calls in one set-based statement
--   complete_many(tasks, tokens, results)    many complete calls, each still fenced by its token
--
-- Neither weakens a guarantee of its single-task sibling: the same validation and error codes,
-- the same lane checks (LF008) before anything is written, the same fence, run row and journal
-- event per task. Both run as their owner with a pinned search_path and are granted like their
-- siblings (see 20261130100400_fleet_roles_rls.sql), at the end of this file.

------------------------------------------------------------------------------------------------
-- enqueue_many

-- p_tasks: a JSON array of objects, one per task, each with the arguments of enqueue_task:
--   key (required, a string of 1 to 200 characters), lane (default: p_lane), payload (an object),
--   title (a string), priority (an integer 0..1000), run_at (a timestamp string) or delay_seconds
--   (a number: run_at = now() + that many seconds), max_attempts (an integer >= 1). A field that is
--   JSON null counts as absent. Any other field is refused (a typo must not pass silently).
--
-- Per element exactly what enqueue_task does: idempotent on key (an existing key returns its id
-- and created = false, whatever lane or payload it was given now; a key given twice in one batch
-- is queued once, by its first element), the same checks and the same SQLSTATEs
-- (LF008 for a lane the key may not work, also for an existing key whose task is in such a lane,
-- LF002 unknown lane, LF005 malformed). All or nothing: the first bad element (by index) raises,
-- its message starts with `p_tasks[<index, from 0>] (key '<key>'): `, and nothing is written.
--
-- One row per element, in input order: (idx from 0, id, key, created).
--
-- Set-based: the elements are checked by one query, converted by one, inserted by one
-- INSERT … ON CONFLICT DO NOTHING and journaled by one multi-row insert. The new tasks get their
-- ids in input order (so a batch of equal priority is claimed in the order it was given, as a
-- loop of enqueue calls would be), but are inserted in key order: two batches that share new keys
-- then wait for each other in the same order and never deadlock.
create or replace function fleet.enqueue_many(p_lane text, p_tasks jsonb)
returns table (idx int, id bigint, key text, created boolean)
language plpgsql
as $$
#variable_conflict use_column
declare
    v_fields constant text[] := array['key', 'lane', 'payload', 'title', 'priority', 'run_at',
                                      'delay_seconds', 'max_attempts'];
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
    v_new_ids bigint[];
    v_new_keys text[];
begin
    if p_tasks is null or jsonb_typeof(p_tasks) <> 'array' then
        perform fleet._raise('LF005',
            format('enqueue_many takes a JSON array of task objects, not %s',
                   coalesce('a JSON ' || jsonb_typeof(p_tasks), 'NULL')));
    end if;
    if jsonb_array_length(p_tasks) = 0 then
        return;
    end if;

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
                   when coalesce(jsonb_typeof(e.t -> 'payload'), 'null') not in ('object', 'null') then 'payload'
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
                'known lanes: ' || coalesce((select string_agg(name, ', ' order by name) from fleet.lanes), 'none')
                || '; run `fleet lanes sync` after adding it to fleet.toml');
        when 'payload' then
            perform fleet._raise('LF005', v_where || format('payload must be a JSON object, not a JSON %s',
                jsonb_typeof(v_bad.detail -> 'payload')));
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
        else  -- 'max_attempts'
            perform fleet._raise('LF005', v_where || format('max_attempts must be an integer of at least 1, not %s',
                left(v_bad.detail ->> 'max_attempts', 40)));
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

    -- 3. insert the new keys (the first element of a key given twice)
    with item as (
        select u.* from unnest(v_idx, v_lane, v_key, v_title, v_payload, v_priority, v_run_at, v_max)
                        as u(idx, lane, key, title, payload, priority, run_at, max_attempts)
    ), firsts as (
        select distinct on (i.key) i.* from item i order by i.key, i.idx
    ), numbered as materialized (
        -- ids drawn in input order (the subquery's ORDER BY is the order nextval runs in)
        select f.*, nextval(v_seq) as new_id from (select * from firsts order by firsts.idx) f
    ), ins as (
        insert into fleet.tasks as t (id, lane, key, title, payload, priority, run_at, max_attempts)
        overriding system value
        select n.new_id, n.lane, n.key, n.title, n.payload, n.priority, n.run_at, n.max_attempts
          from numbered n
         order by n.key  -- the lock order on the key index: see the comment above the function
        on conflict (key) do nothing
        returning t.id, t.key
    )
    select coalesce(array_agg(ins.id), '{}'), coalesce(array_agg(ins.key), '{}') into v_new_ids, v_new_keys from ins;

    -- 4. the keys that existed: in a statement of its own, whose snapshot sees a batch that
    --    committed the same key while the insert waited for it (as enqueue_task does). A key whose
    --    task is in a lane this caller may not work is refused as enqueue_task refuses it.
    select e.idx, e.key, t.lane into v_bad
      from unnest(v_idx, v_key) as e(idx, key)
      join fleet.tasks t on t.key = e.key
      left join unnest(v_new_keys) as n(key) on n.key = e.key
     where n.key is null
       and not (v_allowed is null or t.lane = any (v_allowed))
     order by e.idx
     limit 1;
    if found then
        perform fleet._raise('LF008', format('p_tasks[%s] (key %L): lane %L is not allowed for this key',
            v_bad.idx, left(v_bad.key, 100), v_bad.lane),
            'the key''s fleet_lanes claim lists the lanes it may work; mint one with `fleet keys mint --lane`');
    end if;

    -- 5. one journal row per new task, in input order
    insert into fleet.events (kind, lane, task_id, session_id, detail)
    select 'enqueued', i.lane, n.id, null,
           jsonb_build_object('key', i.key, 'priority', i.priority, 'run_at', i.run_at)
      from unnest(v_new_ids, v_new_keys) as n(id, key)
      join (select distinct on (u.key) u.*
              from unnest(v_idx, v_lane, v_key, v_priority, v_run_at) as u(idx, lane, key, priority, run_at)
             order by u.key, u.idx) i on i.key = n.key
     order by i.idx;

    -- 6. every element: its task, and whether this call created it (only the first element of a new key)
    return query
    select i.idx, coalesce(n.id, t.id), i.key, n.id is not null and i.idx = f.idx
      from unnest(v_idx, v_key) as i(idx, key)
      join (select j.key, min(j.idx) as idx from unnest(v_idx, v_key) as j(idx, key) group by j.key) f
        on f.key = i.key
      left join unnest(v_new_ids, v_new_keys) as n(id, key) on n.key = i.key
      left join fleet.tasks t on n.id is null and t.key = i.key
     order by i.idx;
end
$$;

comment on function fleet.enqueue_many is
    'enqueue_task for many tasks at once, all or nothing: (idx, id, key, created) per element, in input order';

------------------------------------------------------------------------------------------------
-- complete_many

-- Complete many running tasks at once (short tasks: one round trip and one transaction for a
-- batch). Each task is fenced by its own token exactly as fleet.complete fences it: it completes
-- only if that token holds its lease, and then its run row is closed ('done') and a 'completed'
-- event written. A task whose lease is lost (repaired, re-claimed, cancelled, already finished) is
-- left untouched and reported 'lost'. A task id that does not exist is reported 'unknown' (not
-- raised: one purged task must not keep a batch of finished work from being recorded).
--
-- Refused, with nothing changed: arrays of different lengths, a NULL task id or the same task
-- twice (LF005); any named task in a lane the caller may not work (LF008, as complete raises it).
--
-- One row per element, in input order: (task_id, status), status done | lost | unknown.
-- Lock order: the named tasks are locked in id order first (what every transition locks first),
-- then their runs, so two batches, or a batch and the monitor, never deadlock.
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
        update fleet.tasks t
           set state = 'done', result = h.result, finished_at = now(), updated_at = now(),
               lease_token = null, lease_expires_at = null, session_id = null
          from held h
         where t.id = h.id and t.state = 'running' and t.lease_token = h.token
        returning t.id
    ), closed as (
        -- the run of each lease (fleet._end_run)
        update fleet.runs r
           set outcome = 'done', ended_at = now()
          from held h
         where r.lease_token = h.token and r.ended_at is null
    ), journal as (
        insert into fleet.events (kind, lane, task_id, session_id, detail)
        select 'completed', h.lane, h.id, h.session_id, jsonb_build_object('attempt', h.attempts)
          from held h
         order by h.id
    )
    select i.task_id,
           case when d.id is not null then 'done'
                when exists (select 1 from fleet.tasks t where t.id = i.task_id) then 'lost'
                else 'unknown' end
      from item i
      left join done d on d.id = i.task_id
     order by i.ord;
end
$$;

comment on function fleet.complete_many is
    'complete for many tasks at once, each fenced by its token: (task_id, done | lost | unknown) in input order';

------------------------------------------------------------------------------------------------
-- storage of the hot tables
--
-- A HOT update (heap-only tuple) writes the new row version on the same page and no index entry;
-- PostgreSQL can make one only if (a) no indexed column changes (a column of a partial index's
-- predicate counts) and (b) the page has room. Otherwise every index of the table gets a new
-- entry. Measured on PostgreSQL 15 (EXPLAIN (ANALYZE, WAL) of each call, per backend; a shift of
-- 50 running tasks, 22,000 tasks in the table):
--
--   heartbeat of 50 tasks         fillfactor 100: 0% HOT, 460 WAL records, 47 kB per call
--     (as it is, any fillfactor:  tasks_running_lease indexes lease_expires_at, which every
--      heartbeat renews)
--     without tasks_running_lease fillfactor 80: 20-50% HOT; fillfactor 70: 92% HOT,
--                                 154 WAL records, 17 kB per call (a third)
--   checkpoint (no indexed column changes): 62% HOT at fillfactor 100, 78% at 80, 85% at 70
--   an empty claim (its session's heartbeat_at): 8 WAL records, 620 B; 3 records, 191 B and
--     100% HOT without sessions_active_heartbeat
--
-- Transitions that change state (claim, complete, fail, hand_off, …) can never be HOT: state is
-- in the predicates of tasks_ready and the running indexes. fillfactor only applies to pages
-- filled by inserts, so finished rows of the history keep their page's free space: 30% more
-- heap for them, against updates that stay on their page.

-- fleet.tasks: room on each page for the updates of the rows a shift holds (heartbeats,
-- checkpoints, run reports), and a vacuum that follows the live rows' churn instead of the
-- table's size (at the default 20%, a table with a million finished tasks lets 200,000 dead
-- versions of the few live ones pile up in tasks_ready and the running indexes before a
-- vacuum; the claim reads those indexes).
alter table fleet.tasks set (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05
);

-- tasks_running_lease stays for now: it makes every heartbeat a non-HOT update (above), and
-- the monitor's expired-lease scan would be as cheap through tasks_running_lane (the running
-- rows are as many as the fleet's slots: a partial index of running rows read whole, then sorted),
-- but tests/test_reconcile.py pins the expired-lease plan to this index. Dropping it is the
-- single largest saving on the heartbeat path.

-- fleet.sessions: every claim and every heartbeat updates its session's heartbeat_at, which
-- sessions_active_heartbeat indexes, so none of those updates could be HOT. The monitor's stale
-- session scan reads the active sessions (one per running shift) through sessions_active_lane
-- or sessions_active_host as cheaply, and filters heartbeat_at there.
drop index fleet.sessions_active_heartbeat;
alter table fleet.sessions set (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.05,
    autovacuum_vacuum_threshold = 500,
    autovacuum_analyze_scale_factor = 0.05
);

-- fleet.events keeps its four indexes; each has a reader: events_task (a task's journal, `fleet
-- show`), events_session (the monitor's overdue-shift check), events_kind_ts (lane_overview,
-- recent_repairs, throughput and cohort views, queue_deltas), events_ts (the report's first
-- activity). An append-only table: no HOT question, and insert-driven autovacuum keeps its
-- visibility map current for the index-only reads.

------------------------------------------------------------------------------------------------
-- run as the owner, search_path pinned; closed to PUBLIC; granted like enqueue_task and complete

alter function fleet.enqueue_many(text, jsonb) security definer set search_path = pg_catalog, fleet, pg_temp;
alter function fleet.complete_many(bigint[], uuid[], jsonb[]) security definer
    set search_path = pg_catalog, fleet, pg_temp;

revoke execute on function fleet.enqueue_many(text, jsonb), fleet.complete_many(bigint[], uuid[], jsonb[])
    from public;
grant execute on function fleet.enqueue_many(text, jsonb), fleet.complete_many(bigint[], uuid[], jsonb[])
    to service_role;
grant execute on function fleet.enqueue_many(text, jsonb) to fleet_worker, fleet_operator;
grant execute on function fleet.complete_many(bigint[], uuid[], jsonb[]) to fleet_worker;

-- PostgREST, if it runs, reloads its schema cache
notify pgrst, 'reload schema';
