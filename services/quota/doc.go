// Package quota enforces per-principal rate limits and quotas whose
// counters live in SQLite, so a broker restart (or a second broker process
// sharing the same database file) cannot reset or double a quota.
//
// Three budgets are tracked per principal:
//
//   - calls per minute and sandbox creations per hour, each a sliding-window
//     counter: the current fixed window plus the previous window weighted by
//     how much of it still overlaps the last window-length of time. This
//     avoids the 2x burst a plain fixed window allows at its edge.
//   - execution time per day, a UTC calendar-day bucket: the budget resets at
//     00:00 UTC, whatever the server's local time zone. A run reserves its
//     timeout before it starts and settles with its real duration, so runs
//     started at once cannot together overspend; a reservation its broker
//     never settled expires and is charged in full.
//
// Every check-and-consume runs in one BEGIN IMMEDIATE transaction, which
// serialises it against all other writers on the same file, in this process
// or another. Rejected requests are not counted.
//
// The file is the truth; each Store keeps an in-memory view of the
// principals it serves and decides from it. Every write bumps a generation
// in the file, and a transaction that finds a generation other than its
// Store's last drops the view and reads the file again, so admission is
// exact with any number of Stores or processes on one file. get_usage
// reads only the view: exact with one broker process per state.db (the
// supported setup); with several, it shows this process's view as of its
// last write.
package quota
