def test_template_has_the_fleet_tables(conn):
    rows = conn.execute(
        "select table_name from information_schema.tables"
        " where table_schema = 'fleet' and table_type = 'BASE TABLE' order by 1"
    ).fetchall()
    names = {r[0] for r in rows}
    assert {"lanes", "tasks", "sessions", "runs", "lane_handoffs", "events"} <= names
