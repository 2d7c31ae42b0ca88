package agent

// SessionCache is the broker's memory of the session each thread (or
// process) of a sandbox was in at its last full read of /proc, the "after"
// of the previous run's stray check (see Strays). With it the next run's
// "before" costs one read of the cgroup's list instead of a /proc walk:
// an ID it remembers keeps its session, only new IDs are read. A
// remembered session counts only while its leader is still in the sandbox;
// otherwise the ID is read afresh, so a stray that takes the number of a
// session that has ended cannot pass for it. The zero value remembers
// nothing. Not safe for concurrent use (the session's run lock guards it).
type SessionCache struct {
	sid map[int]int // ID → session at the last full read
}

// Record remembers a full read: after maps each session to its IDs.
func (c *SessionCache) Record(after map[int][]int) {
	if after == nil {
		c.sid = nil
		return
	}
	c.sid = make(map[int]int, len(c.sid))
	for sid, ids := range after {
		for _, id := range ids {
			c.sid[id] = sid
		}
	}
}

// Before maps each session of the live IDs ids (the cgroup's list, read
// just now) to its IDs, reading with read only those it does not
// remember; read reports the session of a live ID, ok false for one that
// has gone or runs no code again. It returns nil when nothing is
// remembered yet (the caller then reads /proc in full).
func (c *SessionCache) Before(ids []int, read func(id int) (sid int, ok bool)) Sessions {
	if c.sid == nil || ids == nil {
		return nil
	}
	present := make(map[int]bool, len(ids))
	for _, id := range ids {
		present[id] = true
	}
	out := Sessions{}
	for _, id := range ids {
		sid, ok := c.sid[id]
		if !ok || !present[sid] {
			if sid, ok = read(id); !ok {
				continue
			}
		}
		out[sid] = append(out[sid], id)
	}
	return out
}
