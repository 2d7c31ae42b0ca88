package sandbox

// Compute is one piece of compute a session holds (a container, a
// bubblewrap sandbox), as the operator view shows it.
type Compute struct {
	Kind     string `json:"kind"`               // "container" or "bwrap"
	ID       string `json:"id"`                 // short container ID, or the agent's pid
	Language string `json:"language,omitempty"` // the runner, when one per language
}

// Describer is implemented by sessions that can list their compute.
type Describer interface {
	Compute() []Compute
}
