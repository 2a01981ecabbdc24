"""The course: labs and their graders, lessons and their helpers, figures, chapters, the site, examples."""
