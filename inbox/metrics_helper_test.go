package inbox_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// counterValue reads a counter of c; kind selects the kind label's value
// ("" for a counter without it).
func counterValue(t testing.TB, c prometheus.Collector, name, kind string) float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			match := kind == ""
			for _, l := range m.GetLabel() {
				if l.GetName() == "kind" && l.GetValue() == kind {
					match = true
				}
			}
			if match {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no series %s kind=%q", name, kind)
	return 0
}
