package opsui

import (
	"math"
	"strconv"
	"strings"
	"time"
)

// The overview's charts are inline SVG drawn on the server from the UI's
// own readings (UI.sample): no script draws them and nothing is loaded
// from elsewhere. Each is a line over an area, in a chartWidth ×
// chartHeight box that the stylesheet stretches to the card's width.
const (
	chartWidth  = 240
	chartHeight = 60
	chartPad    = 2 // keeps the line's stroke inside the box at 0 and at the top
)

// uiChart is one chart of the overview.
type uiChart struct {
	ID    string // "backlog", "oldest", "rate"
	Title string
	// Now is the last reading, formatted; Last is its value, which the
	// figure also carries as data-last.
	Now  string
	Last float64
	// Low and High are the values at the bottom and top of the box,
	// formatted; the bottom is 0 unless a value is negative.
	Low, High string
	// Span is the time the points cover.
	Span string
	// Line and Area are the SVG points of the polyline and of the
	// polygon under it; empty with fewer than one point.
	Line, Area string
	Points     int
}

// charts draws the overview's charts from samples, oldest first: the
// backlog, the oldest pending age, and the publish rate (with
// Options.Published) or the backlog's change per second (without).
func (u *UI) charts(samples []uiSample) []uiChart {
	n := len(samples)
	at := make([]time.Time, n)
	backlog, oldest := make([]float64, n), make([]float64, n)
	for i, s := range samples {
		at[i], backlog[i], oldest[i] = s.at, float64(s.pending), float64(s.oldestMs)
	}
	// A rate needs two readings: the first point repeats the second's.
	rate := make([]float64, n)
	for i := 1; i < n; i++ {
		d := samples[i].at.Sub(samples[i-1].at).Seconds()
		if d <= 0 {
			continue
		}
		if u.opts.Published != nil {
			rate[i] = max(samples[i].published-samples[i-1].published, 0) / d
		} else {
			rate[i] = float64(samples[i].pending-samples[i-1].pending) / d
		}
	}
	if n > 1 {
		rate[0] = rate[1]
	}
	count := func(v float64) string { return strconv.FormatInt(int64(math.Round(v)), 10) }
	perSec := func(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) + "/s" }
	ageOf := func(v float64) string { return fmtAgeMs(int64(max(v, 0))) }
	rateChart := uiChart{ID: "rate", Title: "Backlog change"}
	if u.opts.Published != nil {
		rateChart.Title = "Published"
	}
	return []uiChart{
		drawChart(uiChart{ID: "backlog", Title: "Pending"}, at, backlog, count),
		drawChart(uiChart{ID: "oldest", Title: "Oldest pending age"}, at, oldest, ageOf),
		drawChart(rateChart, at, rate, perSec),
	}
}

// drawChart fills c's points and labels from the values v read at at.
func drawChart(c uiChart, at []time.Time, v []float64, format func(float64) string) uiChart {
	n := len(v)
	c.Points = n
	if n == 0 {
		c.Now, c.Low, c.High, c.Span = "–", format(0), format(0), "0s"
		return c
	}
	lo, hi := 0.0, 0.0
	for _, x := range v {
		lo, hi = min(lo, x), max(hi, x)
	}
	if hi == lo {
		hi = lo + 1
	}
	t0, span := at[0], at[n-1].Sub(at[0])
	c.Last, c.Now, c.Low, c.High = v[n-1], format(v[n-1]), format(lo), format(hi)
	c.Span = span.Round(time.Second).String()
	y := func(x float64) float64 {
		return chartPad + (hi-x)/(hi-lo)*(chartHeight-2*chartPad)
	}
	xOf := func(i int) float64 {
		if span <= 0 {
			return chartWidth // one reading: a point at the right edge, now
		}
		return float64(at[i].Sub(t0)) / float64(span) * chartWidth
	}
	var line strings.Builder
	for i := range v {
		if i > 0 {
			line.WriteByte(' ')
		}
		line.WriteString(coord(xOf(i)) + "," + coord(y(v[i])))
	}
	if n == 1 {
		// A single reading is drawn as a short flat line ending now.
		line.Reset()
		line.WriteString(coord(chartWidth-4) + "," + coord(y(v[0])) + " " + coord(chartWidth) + "," + coord(y(v[0])))
	}
	c.Line = line.String()
	base := coord(y(max(lo, 0)))
	first, last := strings.SplitN(c.Line, ",", 2)[0], c.Line[strings.LastIndexByte(c.Line, ' ')+1:]
	last = last[:strings.IndexByte(last, ',')]
	c.Area = first + "," + base + " " + c.Line + " " + last + "," + base
	return c
}

// coord writes an SVG coordinate with one decimal.
func coord(f float64) string { return strconv.FormatFloat(f, 'f', 1, 64) }
