package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/textparse"
)

// scrapes is the repeated --scrape node=FILE.
type scrapes []string

func (s *scrapes) String() string     { return strings.Join(*s, ",") }
func (s *scrapes) Set(v string) error { *s = append(*s, v); return nil }

// The parts of a Grafana dashboard its queries live in: panels (rows hold
// theirs), each with its targets.
type dashboard struct {
	Title  string  `json:"title"`
	Panels []panel `json:"panels"`
}

type panel struct {
	Title   string   `json:"title"`
	Type    string   `json:"type"`
	Targets []target `json:"targets"`
	Panels  []panel  `json:"panels"`
}

type target struct {
	Expr string `json:"expr"`
}

// The scrape interval the samples are spaced by, and what the dashboard's
// variables stand for: every value (a variable set to All), and Grafana's
// rate interval at that scrape interval.
const (
	scrapeInterval = 15 * time.Second
	rateInterval   = "1m"
)

func panelsMain(args []string) error {
	flags := flag.NewFlagSet("panels", flag.ContinueOnError)
	path := flags.String("dashboard", "", "the Grafana dashboard JSON")
	var files scrapes
	flags.Var(&files, "scrape", "node=FILE, a scrape of that node's daemon (repeatable)")
	if err := flags.Parse(args); err != nil {
		return err
	}
	text, err := os.ReadFile(*path)
	if err != nil {
		return err
	}
	var d dashboard
	if err := json.Unmarshal(text, &d); err != nil {
		return fmt.Errorf("%s: %w", *path, err)
	}
	s, err := openStore()
	if err != nil {
		return err
	}
	defer s.close()
	// Each scrape twice, a scrape interval apart, so rates have two samples.
	start := time.Unix(1_700_000_000, 0)
	for _, f := range files {
		node, file, ok := strings.Cut(f, "=")
		if !ok {
			return fmt.Errorf("--scrape %q: want node=FILE", f)
		}
		for i := range 2 {
			at := start.Add(time.Duration(i) * scrapeInterval)
			if err := load(s, file, node, at); err != nil {
				return fmt.Errorf("%s: %w", file, err)
			}
		}
	}
	now := start.Add(scrapeInterval)
	var failed []string
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			walk(p.Panels)
			for _, t := range p.Targets {
				expr := strings.NewReplacer("$__rate_interval", rateInterval, "$node", ".*", "$namespace", ".*").Replace(t.Expr)
				v, err := s.query(expr, now)
				switch {
				case err != nil:
					failed = append(failed, fmt.Sprintf("%q: %s: %v", p.Title, t.Expr, err))
				case len(v) == 0:
					failed = append(failed, fmt.Sprintf("%q: %s: no series", p.Title, t.Expr))
				default:
					fmt.Printf("%-50s %3d series  %s\n", p.Title, len(v), oneLine(t.Expr))
				}
			}
		}
	}
	walk(d.Panels)
	if len(failed) > 0 {
		return errors.New(strings.Join(failed, "\n"))
	}
	return nil
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// load appends one scrape (OpenMetrics text, as the daemon serves it) at
// `at`, every series labelled with `node` as the ServiceMonitor labels it.
func load(s *store, file, node string, at time.Time) error {
	text, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	p, err := textparse.New(text, "application/openmetrics-text; version=1.0.0; charset=utf-8", labels.NewSymbolTable(), textparse.ParserOptions{})
	if err != nil {
		return err
	}
	app := s.db.Appender(context.Background())
	var lbls labels.Labels
	for {
		entry, err := p.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		if entry != textparse.EntrySeries {
			continue
		}
		_, _, value := p.Series()
		p.Labels(&lbls)
		b := labels.NewBuilder(lbls)
		b.Set("node", node)
		b.Set("job", "gpu-device-plugin")
		if _, err := app.Append(0, b.Labels(), at.UnixMilli(), value); err != nil {
			return err
		}
	}
	return app.Commit()
}
