package opshttp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/opstest"
	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/ops/opshttp"
	"github.com/gorm-outbox/outbox/relay"
)

type httpClient struct {
	t   *testing.T
	srv *httptest.Server
}

// do sends a request and decodes the JSON answer into out (if non-nil).
func (c httpClient) do(method, path, body string, out any) int {
	c.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, c.srv.URL+path, rd)
	require.NoError(c.t, err)
	resp, err := c.srv.Client().Do(req)
	require.NoError(c.t, err)
	defer resp.Body.Close()
	require.Equal(c.t, "application/json", resp.Header.Get("Content-Type"))
	raw, err := io.ReadAll(resp.Body)
	require.NoError(c.t, err)
	if out != nil {
		require.NoError(c.t, json.Unmarshal(raw, out), "%s", raw)
	}
	return resp.StatusCode
}

type deadPage struct {
	Items []map[string]any `json:"items"`
	Next  string           `json:"next"`
}

// list GETs a page of dead letters.
func (c httpClient) list(path string) deadPage {
	c.t.Helper()
	var p deadPage
	require.Equal(c.t, http.StatusOK, c.do("GET", path, "", &p))
	return p
}

func TestHandler(t *testing.T) {
	t.Parallel()
	opstest.ForEach(t, 4, func(t *testing.T, b *opstest.Backend) {
		admin := b.Op
		b.Insert(t, relay.Message{ID: 100, MessageID: "p", Bucket: 1, Topic: "orders", Key: []byte("k"), Value: []byte("k/9")})
		old := time.Now().Add(-72 * time.Hour)
		b.InsertDead(t,
			ops.DeadLetter{ID: 1, MessageID: "d-1", Bucket: 1, Topic: "orders", Key: []byte("k"), Value: []byte("k/0"), LastError: "rejected", DeadAt: old},
			ops.DeadLetter{ID: 2, MessageID: "d-2", Bucket: 1, Topic: "orders", Key: []byte("k"), Value: []byte("k/1"), State: "parked", DeadAt: old},
			ops.DeadLetter{ID: 3, MessageID: "d-3", Bucket: 2, Topic: "payments", Value: []byte("n/0")},
		)

		ro := httpClient{t, httptest.NewServer(opshttp.NewHandler(admin, opshttp.Options{Logger: dbtest.Logger(t)}))}
		defer ro.srv.Close()

		var st ops.Status
		require.Equal(t, http.StatusOK, ro.do("GET", "/status", "", &st))
		require.EqualValues(t, 1, st.Pending)
		require.Equal(t, ops.DeadLetterCounts{Failed: 2, Parked: 1}, st.DeadLetters)
		require.Len(t, st.Buckets, 4)
		require.Nil(t, st.WAL, "table mode has no slot")
		var notWAL map[string]string
		require.Equal(t, http.StatusNotFound, ro.do("GET", "/wal", "", &notWAL))
		require.Contains(t, notWAL["error"], "not in WAL mode")

		var page deadPage
		page = ro.list("/dead-letters?topic=orders&limit=1")
		require.Len(t, page.Items, 1)
		require.EqualValues(t, 2, page.Items[0]["id"])
		require.Equal(t, "k", page.Items[0]["key"])
		require.Equal(t, "parked", page.Items[0]["state"])
		require.NotEmpty(t, page.Next)
		page = ro.list("/dead-letters?topic=orders&limit=1&cursor=" + page.Next)
		require.EqualValues(t, 1, page.Items[0]["id"])
		require.Empty(t, page.Next)
		page = ro.list("/dead-letters?keyless=true")
		require.Len(t, page.Items, 1)
		page = ro.list("/dead-letters?until=24h")
		require.Len(t, page.Items, 2)
		page = ro.list("/dead-letters?key_base64=bm9uZQ==")
		require.Empty(t, page.Items)

		var one map[string]any
		require.Equal(t, http.StatusOK, ro.do("GET", "/dead-letters/1", "", &one))
		require.Equal(t, "rejected", one["last_error"])
		require.Equal(t, "ay8w", one["value_base64"]) // "k/0"
		var counts map[string]int64
		require.Equal(t, http.StatusOK, ro.do("GET", "/dead-letters/count", "", &counts))
		require.Equal(t, map[string]int64{"failed": 2, "parked": 1, "total": 3}, counts)

		var e map[string]string
		require.Equal(t, http.StatusNotFound, ro.do("GET", "/dead-letters/99", "", &e))
		require.Contains(t, e["error"], "not found")
		require.Equal(t, http.StatusBadRequest, ro.do("GET", "/dead-letters/x", "", &e))
		require.Equal(t, http.StatusBadRequest, ro.do("GET", "/dead-letters?state=lost", "", &e))
		require.Equal(t, http.StatusBadRequest, ro.do("GET", "/dead-letters?since=yesterday", "", &e))

		// Mutations are refused unless the service opts in.
		for _, m := range []struct{ method, path, body string }{
			{"POST", "/dead-letters/requeue", `{"all":true}`},
			{"POST", "/dead-letters/purge", `{"older_than":"1h"}`},
			{"POST", "/dead-letters/discard", `{"ids":[1]}`},
			{"DELETE", "/dead-letters/1", ""},
			{"POST", "/buckets/1/pause", ""},
			{"PUT", "/status", ""},
		} {
			e = nil
			require.Equal(t, http.StatusForbidden, ro.do(m.method, m.path, m.body, &e), "%s %s", m.method, m.path)
			require.Contains(t, e["error"], "AllowMutations")
		}
		c, err := admin.CountDeadLetters(t.Context())
		require.NoError(t, err)
		require.EqualValues(t, 3, c.Total(), "nothing changed")
		require.Equal(t, http.StatusOK, ro.do("GET", "/status", "", &st))
		for _, bs := range st.Buckets {
			require.Zero(t, bs.Lease.Term, "nothing changed")
		}

		rw := httpClient{t, httptest.NewServer(opshttp.NewHandler(admin, opshttp.Options{AllowMutations: true, Logger: dbtest.Logger(t)}))}
		defer rw.srv.Close()
		require.Equal(t, http.StatusBadRequest, rw.do("POST", "/dead-letters/requeue", `{"ids":[1],"key":"k"}`, &e))
		require.Equal(t, http.StatusBadRequest, rw.do("POST", "/dead-letters/requeue", `{"topic":"orders"}`, &e))
		require.Equal(t, http.StatusBadRequest, rw.do("POST", "/dead-letters/requeue", `{"bogus":1}`, &e))
		var res ops.RequeueResult
		require.Equal(t, http.StatusOK, rw.do("POST", "/dead-letters/requeue", `{"key":"k"}`, &res))
		require.Equal(t, ops.RequeueResult{Requeued: 2, Moved: 1, Buckets: []int{1}}, res)
		require.Equal(t, []string{"k/0", "k/1", "k/9"}, pendingValues(t, b))

		var purged map[string]any
		require.Equal(t, http.StatusBadRequest, rw.do("POST", "/dead-letters/purge", `{}`, &e))
		require.Equal(t, http.StatusOK, rw.do("POST", "/dead-letters/purge", `{"older_than":"1h"}`, &purged))
		require.EqualValues(t, 0, purged["purged"])
		require.Equal(t, http.StatusOK, rw.do("DELETE", "/dead-letters/3", "", nil))
		require.Equal(t, http.StatusNotFound, rw.do("DELETE", "/dead-letters/3", "", &e))
		c, err = admin.CountDeadLetters(t.Context())
		require.NoError(t, err)
		require.Zero(t, c.Total())
		require.Len(t, pendingValues(t, b), 3, "pending messages are never deleted")

		require.Equal(t, http.StatusOK, rw.do("POST", "/buckets/2/pause", "", nil))
		require.Equal(t, http.StatusBadRequest, rw.do("POST", "/buckets/9/pause", "", &e))
		require.Equal(t, http.StatusBadRequest, rw.do("POST", "/buckets/x/pause", "", &e))
		require.Equal(t, http.StatusOK, ro.do("GET", "/status", "", &st))
		require.True(t, st.Buckets[2].Lease.Paused)
		require.Equal(t, http.StatusOK, rw.do("POST", "/buckets/2/resume", "", nil))
		require.Equal(t, http.StatusOK, ro.do("GET", "/status", "", &st))
		require.False(t, st.Buckets[2].Lease.Paused)
		require.Equal(t, http.StatusMethodNotAllowed, rw.do("POST", "/status", "", nil))
	})
}

// pendingValues lists the pending messages' values by id.
func pendingValues(t *testing.T, b *opstest.Backend) []string {
	var out []string
	for _, m := range b.Pending(t) {
		out = append(out, string(m.Value))
	}
	return out
}

// roundTripDeadLetters covers every shape of key, value and header a dead
// letter can have: text, binary, empty, keyless or tombstone, nil, and
// the note that a copy may have been delivered.
func roundTripDeadLetters() []ops.DeadLetter {
	part := int32(3)
	return []ops.DeadLetter{
		{ID: 1, MessageID: "d-1", Bucket: 1, Topic: "orders", Key: []byte("order-7"), Value: []byte(`{"id":7}`), Partition: &part, Attempts: 10,
			LastError: `publisher: message 0 (id "m", topic "orders"): permanent: boom` + "\n" + ops.MaybeDeliveredPrefix + "a publish was attempted and its outcome is unknown",
			Headers:   []relay.Header{{Key: "text", Value: []byte("v")}, {Key: "bin", Value: []byte{0xff, 0}}, {Key: "nil"}}},
		{ID: 2, MessageID: "d-2", Bucket: 1, Topic: "orders", Key: []byte{0xff, 0xfe}, Value: []byte{0, 1, 2}, State: "parked"},
		{ID: 3, MessageID: "d-3", Bucket: 2, Topic: "orders", Key: []byte{}, Value: []byte{}},
		{ID: 4, MessageID: "d-4", Bucket: 2, Topic: "orders"}, // keyless tombstone
	}
}

// utcTimes makes dead letters comparable after a JSON round trip, which
// keeps the instant but not the *time.Location.
func utcTimes(ds ...ops.DeadLetter) []ops.DeadLetter {
	for i := range ds {
		ds[i].CreatedAt, ds[i].DeadAt = ds[i].CreatedAt.UTC(), ds[i].DeadAt.UTC()
	}
	return ds
}

// The admin API's dead-letter JSON decodes back into the Go types.
func TestHandlerJSONRoundTrip(t *testing.T) {
	t.Parallel()
	opstest.ForEach(t, 4, func(t *testing.T, b *opstest.Backend) {
		ctx := context.Background()
		admin := b.Op
		b.InsertDead(t, roundTripDeadLetters()...)
		c := httpClient{t, httptest.NewServer(opshttp.NewHandler(admin, opshttp.Options{Logger: dbtest.Logger(t)}))}
		defer c.srv.Close()

		want, err := admin.DeadLetters(ctx, ops.DeadLetterQuery{})
		require.NoError(t, err)
		require.Len(t, want.Items, 4)
		var got ops.DeadLetterPage
		require.Equal(t, http.StatusOK, c.do("GET", "/dead-letters", "", &got))
		require.Equal(t, utcTimes(want.Items...), utcTimes(got.Items...))
		require.True(t, got.Items[len(got.Items)-1].MaybeDelivered, "the delivery note survives the round trip")
		require.Equal(t, want.Next, got.Next)

		for _, d := range want.Items {
			one, err := admin.DeadLetter(ctx, d.ID)
			require.NoError(t, err)
			var gotOne ops.DeadLetter
			require.Equal(t, http.StatusOK, c.do("GET", fmt.Sprintf("/dead-letters/%d", d.ID), "", &gotOne))
			require.Equal(t, utcTimes(one), utcTimes(gotOne), "dead letter %d", d.ID)
		}
		// The shapes survive: nil stays nil, empty stays empty.
		var keyless, empty ops.DeadLetter
		require.Equal(t, http.StatusOK, c.do("GET", "/dead-letters/4", "", &keyless))
		require.Nil(t, keyless.Key)
		require.Nil(t, keyless.Value)
		require.Equal(t, http.StatusOK, c.do("GET", "/dead-letters/3", "", &empty))
		require.Equal(t, []byte{}, empty.Key)
		require.Equal(t, []byte{}, empty.Value)
	})
}
