"""`gpuflex web`: the read-only dashboard (gpuflex.web.app), its pages and plots."""
