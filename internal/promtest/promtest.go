// Package promtest reads gathered Prometheus series in tests.
package promtest

import (
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// Series gathers g and returns the value of every series of the family
// name, keyed by its labels other than outbox, joined as "bucket=3,kind=x"
// ("" for none). Counters and gauges give their value, histograms their
// sample count. A non-empty outbox is the value every series' outbox
// label must have.
func Series(t require.TestingT, g prometheus.Gatherer, name, outbox string) map[string]float64 {
	if h, ok := t.(interface{ Helper() }); ok {
		h.Helper()
	}
	mfs, err := g.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				switch {
				case l.GetName() != "outbox":
					labels = append(labels, l.GetName()+"="+l.GetValue())
				case outbox != "":
					require.Equal(t, outbox, l.GetValue(), "the outbox label of %s", name)
				}
			}
			out[strings.Join(labels, ",")] = m.GetGauge().GetValue() + m.GetCounter().GetValue() + float64(m.GetHistogram().GetSampleCount())
		}
	}
	return out
}
