//go:build race

package chaos_test

// raceEnabled reports whether this test binary runs under the race
// detector; the relay processes are then built with -race too.
const raceEnabled = true
