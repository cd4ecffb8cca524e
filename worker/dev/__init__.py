"""Development tooling, apart from runtime code: the local Supabase stack, the scripted example agent
and the generator of migrations from the schema sources (sqlsources)."""
