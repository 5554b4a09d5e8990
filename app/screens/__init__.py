"""One file per dashboard page; ``app/main.py`` runs them through ``st.navigation``."""

#: Pages in navigation order: (key = file name and URL path, title, icon, help).
PAGES = (
    ("runs", "Runs", ":material/list:", "Every run with its settings and headline numbers"),
    ("overview", "Overview", ":material/monitoring:", "KL, top-1 agreement, dropped mass and the verdict"),
    ("tokens", "Tokens", ":material/text_fields:", "The text coloured by when each token was evicted"),
    ("heads", "Heads", ":material/grid_on:", "Coverage and dropped mass per layer and head"),
    ("dynamics", "Dynamics", ":material/trending_up:", "Promotion, heavy threshold, slot age, freezing"),
    ("evictions", "Evictions", ":material/table_rows:", "Filterable eviction table and margin histogram"),
    ("compare", "Compare", ":material/compare_arrows:", "Two runs on the same tokens side by side"),
    ("report", "Report", ":material/description:", "Attribution and report downloads"),
    ("sql", "SQL", ":material/terminal:", "Read-only SQL console over the views"),
)
