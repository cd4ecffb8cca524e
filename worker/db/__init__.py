"""The database itself: the embedded PostgreSQL server, and the migrations that make its schema."""
