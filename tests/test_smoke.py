def test_template_has_fleet_schema(conn):
    row = conn.execute("select count(*) from information_schema.tables where table_schema='fleet'").fetchone()
    assert row[0] == 6
