package metrics_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/gorm-outbox/outbox/metrics"
	"github.com/gorm-outbox/outbox/relay"
)

const (
	dashboardFile = "../deploy/grafana/outbox-dashboard.json"
	alertsFile    = "../deploy/prometheus/alerts.yml"
	alertsTests   = "../deploy/prometheus/alerts_test.yml"
	docFile       = "../docs/observability.md"
)

// exportedNames returns every series name the collector can export:
// counter and gauge family names, and a histogram's _bucket, _sum and
// _count series.
func exportedNames(t *testing.T) map[string]bool {
	t.Helper()
	c, err := metrics.New(metrics.Config{})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	// Make every family appear.
	now := time.Now()
	c.BacklogSampled(relay.Backlog{BucketCount: 1, Pending: 1, Oldest: now, DeadLettersKnown: true, PausedKnown: true, SampledAt: now,
		Buckets: []relay.BucketBacklog{{Bucket: 0, Pending: 1, Oldest: now}}})
	ib, err := metrics.NewInbox(metrics.InboxConfig{})
	require.NoError(t, err)
	require.NoError(t, reg.Register(ib))
	ib.Processed("t")
	ib.DuplicateSkipped("t")
	ib.Purged(1)
	mfs, err := reg.Gather()
	require.NoError(t, err)
	names := map[string]bool{}
	for _, mf := range mfs {
		names[mf.GetName()] = true
		if mf.GetType() == dto.MetricType_HISTOGRAM {
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				names[mf.GetName()+suffix] = true
			}
		}
	}
	require.Len(t, mfs, 22, "every family gathered")
	return names
}

var metricNameRE = regexp.MustCompile(`\boutbox_[a-z_]+\b`)

// requireKnownMetrics checks that every outbox_* name in expr is exported
// and returns them.
func requireKnownMetrics(t *testing.T, exported map[string]bool, where, expr string) []string {
	t.Helper()
	used := metricNameRE.FindAllString(expr, -1)
	require.NotEmpty(t, used, "%s: %q uses no outbox metric", where, expr)
	for _, name := range used {
		require.True(t, exported[name], "%s: %q uses %s, which the collector does not export", where, expr, name)
	}
	return used
}

func TestDashboard(t *testing.T) {
	t.Parallel()
	exported := exportedNames(t)
	raw, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	var dash struct {
		Title  string `json:"title"`
		UID    string `json:"uid"`
		Panels []struct {
			Type       string `json:"type"`
			Title      string `json:"title"`
			Datasource any    `json:"datasource"`
			Targets    []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	require.NoError(t, json.Unmarshal(raw, &dash))
	require.NotEmpty(t, dash.Title)
	require.NotEmpty(t, dash.UID)

	used := map[string]bool{}
	titles := map[string]bool{}
	for _, p := range dash.Panels {
		require.NotEmpty(t, p.Title)
		require.False(t, titles[p.Title], "duplicate panel title %q", p.Title)
		titles[p.Title] = true
		if p.Type == "row" {
			continue
		}
		require.NotNil(t, p.Datasource, p.Title)
		require.NotEmpty(t, p.Targets, p.Title)
		for _, tg := range p.Targets {
			require.Contains(t, tg.Expr, `outbox=~"$outbox"`, "%s: every query follows the outbox variable", p.Title)
			require.NotContains(t, tg.Expr, "vector(0)", "%s: a missing sample must not be drawn as zero", p.Title)
			for _, n := range requireKnownMetrics(t, exported, "panel "+p.Title, tg.Expr) {
				used[n] = true
			}
		}
	}
	for _, v := range dash.Templating.List {
		if v.Definition != "" {
			requireKnownMetrics(t, exported, "variable "+v.Name, v.Definition)
		}
	}
	// What the dashboard is for.
	for _, name := range []string{
		metrics.NameAcknowledged,     // throughput
		metrics.NamePublishFailures,  // failures
		metrics.NamePending,          // backlog
		metrics.NamePendingOldestAge, // oldest age
		metrics.NameBucketOldestAge,  // oldest age per bucket
		metrics.NameOwnedBuckets,     // owned buckets per relay
		metrics.NameDeadLetters,      // dead letters
		metrics.NameDeadLettered,
		metrics.NamePendingAvailable,
		metrics.NamePublishDuration + "_bucket",
		metrics.NameLeaseExpirations,
	} {
		require.True(t, used[name], "the dashboard shows no %s", name)
	}
}

// alertRules is the structure of a Prometheus rules file.
type alertRules struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Record      string            `yaml:"record"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// anchors returns the GitHub anchors of the markdown headings in file.
func anchors(t *testing.T, file string) map[string]bool {
	t.Helper()
	raw, err := os.ReadFile(file)
	require.NoError(t, err)
	out := map[string]bool{}
	drop := regexp.MustCompile(`[^a-z0-9 _-]`)
	for line := range strings.SplitSeq(string(raw), "\n") {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.ToLower(strings.TrimSpace(strings.TrimLeft(line, "#")))
		out[strings.ReplaceAll(drop.ReplaceAllString(h, ""), " ", "-")] = true
	}
	return out
}

func TestAlertRules(t *testing.T) {
	t.Parallel()
	exported := exportedNames(t)
	docAnchors := anchors(t, docFile)
	raw, err := os.ReadFile(alertsFile)
	require.NoError(t, err)
	var rules alertRules
	dec := yaml.NewDecoder(strings.NewReader(string(raw)))
	dec.KnownFields(true)
	require.NoError(t, dec.Decode(&rules))
	require.NotEmpty(t, rules.Groups)

	var names []string
	for _, g := range rules.Groups {
		require.NotEmpty(t, g.Name)
		for _, r := range g.Rules {
			require.NotEmpty(t, r.Alert, "only alerting rules: %+v", r)
			require.NotContains(t, names, r.Alert, "duplicate alert")
			names = append(names, r.Alert)
			if r.For != "" {
				_, err := time.ParseDuration(strings.Replace(r.For, "d", "h", 1))
				require.NoError(t, err, "%s: for", r.Alert)
			}
			requireKnownMetrics(t, exported, "alert "+r.Alert, r.Expr)
			require.Contains(t, []string{"critical", "warning", "info"}, r.Labels["severity"], r.Alert)
			require.NotEmpty(t, r.Annotations["summary"], r.Alert)
			require.NotEmpty(t, r.Annotations["description"], r.Alert)
			doc, anchor, ok := strings.Cut(r.Annotations["runbook"], "#")
			require.True(t, ok, "%s: runbook", r.Alert)
			require.Equal(t, "docs/observability.md", doc, r.Alert)
			require.True(t, docAnchors[anchor], "%s: runbook anchor #%s is no heading of %s", r.Alert, anchor, docFile)
			require.NotContains(t, r.Expr, "relay_id", "%s: relays are told apart by scrape labels", r.Alert)
		}
	}
	// What the alerts are for.
	for _, want := range []string{
		"OutboxOldestPendingMessageTooOld", "OutboxSinkUnavailable", "OutboxPublishFailing", "OutboxPermanentPublishFailure",
		"OutboxLeaseExpirations", "OutboxBacklogSampleUnavailable", "OutboxDeadLettersGrowing",
		"OutboxInboxProcessingFailing", "OutboxBucketPaused",
	} {
		require.True(t, slices.Contains(names, want), "missing alert %s", want)
	}
}

// With promtool (Debian package prometheus) the rules are checked by
// Prometheus' own parser and their unit tests run; without it this test
// is skipped and TestAlertRules' structural checks stand alone.
func TestAlertRulesPromtool(t *testing.T) {
	t.Parallel()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("OUTBOX_REQUIRE_PROMTOOL") != "" {
			t.Fatal("promtool required (OUTBOX_REQUIRE_PROMTOOL) but not on PATH; apt-get install prometheus")
		}
		t.Skip("promtool not on PATH (apt-get install prometheus): alert expressions not checked by Prometheus' parser")
	}
	dir, err := filepath.Abs(filepath.Dir(alertsFile))
	require.NoError(t, err)
	for _, args := range [][]string{
		{"check", "rules", filepath.Base(alertsFile)},
		{"test", "rules", filepath.Base(alertsTests)},
	} {
		cmd := exec.CommandContext(t.Context(), promtool, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
	}
}
