"""One file per dashboard page; ``app/main.py`` runs them through ``st.navigation``."""
