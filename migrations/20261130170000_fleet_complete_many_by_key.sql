-- lanefleet: fleet.complete_many reads and writes each task by its key (issue #7; bench/README.md,
-- "Batch mode: complete_many by key").
--
-- The version of 20261130130000_fleet_guardrails.sql joined its common table expressions to one
-- another. PostgreSQL estimates a CTE that reads the running tasks at one row (few tasks run), so
-- the update of the tasks and the close of the runs were nested loops that scanned every running
-- task (every open run) of the fleet once per named task: a batch of 100 compared 10,000 pairs,
-- and the cost grew with the fleet's running work. _done_state was also called three times per
-- task. Now the held tasks are read once into arrays (after the same lock, in id order), and each
-- write finds its rows through their keys: tasks by id (tasks_pkey), runs by lease token
-- (run_lease_token_unique). The done state is read once per lane.
--
-- Same signature, same answers (done | review | lost | unknown per element, in input order), same
-- refusals (LF005, LF008) with nothing changed, same lock order.

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
