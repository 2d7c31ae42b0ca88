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
package quota
